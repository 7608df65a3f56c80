"""Configuration of the relay tree (paper §7.1, App. B "Transports"): :class:`RelayConfig`,
the bounds and timers every relay node and receiver keeps to; :func:`balanced_tree`, the shape
of the tree; and :class:`Held`, what one place holds of payloads against its bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dcr.adapters.transport.relay.frames import HEADER_LIMIT
from dcr.errors import ConfigError

__all__ = ["Held", "RelayConfig", "balanced_tree"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayConfig:
    """Bounds and timers of the relay tree; the defaults suit payloads of up to 1 GiB.

    A node holds at most ``max_buffered`` payloads and ``max_buffered_bytes`` bytes (one payload
    is always admitted into an empty buffer, so the byte bound is at least one payload); a
    receiver holds at most ``receiver_window`` deliveries it has not taken yet (a count only:
    the receiver engine keeps one of them free for the payload its declared order needs next,
    so a byte bound there could stall it).  ``hwm`` is ZeroMQ's SNDHWM/RCVHWM in messages;
    windows keep payload frames far below it.
    """

    max_payload_bytes: int = 1 << 30
    max_buffered: int = 32
    max_buffered_bytes: int = 1 << 30
    receiver_window: int = 8
    ping_interval_s: float = 0.25
    peer_timeout_s: float = 3.0
    hwm: int = 10_000
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_payload_bytes",
            "max_buffered",
            "max_buffered_bytes",
            "receiver_window",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"relay {name} must be at least 1")
        if not 0 < self.ping_interval_s < self.peer_timeout_s:
            raise ConfigError("relay ping_interval_s must be positive and below peer_timeout_s")
        if self.hwm < 4 * max(self.max_buffered, self.receiver_window):
            raise ConfigError("relay hwm must be at least 4x the largest window")
        if self.link_gbps is not None and self.link_gbps < 0:
            raise ConfigError("relay link_gbps must be >= 0 (0 or None: no limit)")

    @property
    def max_message_bytes(self) -> int:
        """ZeroMQ ``MAXMSGSIZE``: a larger frame is refused before it is allocated."""
        return self.max_payload_bytes + HEADER_LIMIT


@dataclass(frozen=True, slots=True, kw_only=True)
class Held:
    """What one place holds of payloads: now, at its peak, and its bound."""

    count: int
    bytes: int
    peak_count: int
    peak_bytes: int
    max_count: int
    max_bytes: int


def balanced_tree(node_names: Sequence[str], fanout: int) -> dict[str, str | None]:
    """Parent of each node in a balanced tree: node 0 is the root, node i's parent is
    node ``(i - 1) // fanout`` (paper §7.1: the root forwards over a balanced tree)."""
    if fanout < 1:
        raise ConfigError("relay tree fanout must be at least 1")
    if len(set(node_names)) != len(node_names):
        raise ConfigError("relay node names must be unique")
    return {
        name: None if i == 0 else node_names[(i - 1) // fanout] for i, name in enumerate(node_names)
    }
