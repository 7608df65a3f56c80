"""Configuration of the ZeroMQ control channel: addresses, timers and bounds
(:class:`ZmqControlConfig`).  Keys are the fleet's (:class:`~dcr.adapters.security.Security`),
given to :class:`~dcr.adapters.control.zmq.channel.ZmqControl` beside this configuration."""

from __future__ import annotations

from dataclasses import dataclass

from dcr.adapters.control.base import PENDING_CALLS
from dcr.adapters.control.codec import MAX_BYTES
from dcr.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqControlConfig:
    """Addresses, timers and bounds of the ZeroMQ control channel.

    ``bind`` is where coordinator links listen (port 0: a free one); ``ping_s`` is the
    heartbeat interval of both sides; ``peer_timeout_s`` the silence after which an endpoint
    counts as gone; ``watch_s`` how often an endpoint reads the commit store for a new
    coordinator; ``max_message_bytes`` bounds one frame (ZeroMQ refuses frames above twice
    that before allocating them); ``pending_calls`` bounds the calls waiting per endpoint;
    ``replies_buffer`` the replies waiting for the coordinator to read them, of which one
    endpoint may hold at most ``replies_per_endpoint`` (a flooding peer cannot crowd the
    others out); ``hwm`` is ZeroMQ's SNDHWM/RCVHWM in messages.
    """

    bind: str = "tcp://127.0.0.1:0"
    ping_s: float = 0.5
    peer_timeout_s: float = 3.0
    watch_s: float = 0.2
    max_message_bytes: int = MAX_BYTES
    pending_calls: int = PENDING_CALLS
    replies_buffer: int = 1 << 16
    replies_per_endpoint: int = 1 << 12
    hwm: int = 10_000

    def __post_init__(self) -> None:
        if not 0 < self.ping_s < self.peer_timeout_s:
            raise ConfigError("control ping_s must be positive and below peer_timeout_s")
        if not self.watch_s > 0:
            raise ConfigError("control watch_s must be positive")
        for name in ("pending_calls", "replies_buffer", "replies_per_endpoint", "hwm"):
            if getattr(self, name) < 1:
                raise ConfigError(f"control {name} must be at least 1")
