"""Configuration of the ZeroMQ control channel: addresses, timers and bounds
(:class:`ZmqControlConfig`), CURVE key files (:class:`CurveConfig`) and reading those keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from dcr.adapters.control.base import PENDING_CALLS
from dcr.adapters.control.codec import MAX_BYTES
from dcr.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class CurveConfig:
    """CURVE key files (``zmq.auth.create_certificates``); each role reads the ones it needs.

    A coordinator needs ``server_secret_file`` and ``authorized_clients_dir`` (the public
    certificates of every endpoint allowed in); an endpoint needs ``client_secret_file`` and
    ``server_public_file``.
    """

    server_secret_file: str | Path | None = None
    authorized_clients_dir: str | Path | None = None
    client_secret_file: str | Path | None = None
    server_public_file: str | Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ZmqControlConfig:
    """Addresses, timers and bounds of the ZeroMQ control channel.

    ``bind`` is where coordinator links listen (port 0: a free one); ``ping_s`` is the
    heartbeat interval of both sides; ``peer_timeout_s`` the silence after which an endpoint
    counts as gone; ``watch_s`` how often an endpoint reads the commit store for a new
    coordinator; ``max_message_bytes`` bounds one frame (ZeroMQ refuses frames above twice
    that before allocating them); ``pending_calls`` bounds the calls waiting per endpoint;
    ``replies_buffer`` the replies waiting for the coordinator to read them; ``hwm`` is
    ZeroMQ's SNDHWM/RCVHWM in messages.
    """

    bind: str = "tcp://127.0.0.1:0"
    ping_s: float = 0.5
    peer_timeout_s: float = 3.0
    watch_s: float = 0.2
    max_message_bytes: int = MAX_BYTES
    pending_calls: int = PENDING_CALLS
    replies_buffer: int = 1 << 16
    hwm: int = 10_000
    curve: CurveConfig | None = None

    def __post_init__(self) -> None:
        if not 0 < self.ping_s < self.peer_timeout_s:
            raise ConfigError("control ping_s must be positive and below peer_timeout_s")
        if not self.watch_s > 0:
            raise ConfigError("control watch_s must be positive")
        for name in ("pending_calls", "replies_buffer", "hwm"):
            if getattr(self, name) < 1:
                raise ConfigError(f"control {name} must be at least 1")


def load_keys(path: str | Path | None, what: str, *, secret: bool) -> tuple[bytes, bytes]:
    if path is None:
        raise ConfigError(f"CURVE needs the {what}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the {what} {str(path)!r}: {exc}") from exc
    if secret and secret_key is None:
        raise ConfigError(f"the {what} {str(path)!r} holds no secret key")
    return public, secret_key or b""


def authorized_keys(directory: str | Path | None) -> frozenset[bytes]:
    if directory is None:
        raise ConfigError("CURVE needs authorized_clients_dir")
    if not Path(directory).is_dir():
        raise ConfigError(f"authorized_clients_dir {str(directory)!r} is not a directory")
    try:
        return frozenset(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the certificates in {str(directory)!r}: {exc}") from exc
