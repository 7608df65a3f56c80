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

    **Payloads and buffers.**  ``max_payload_bytes`` is the largest payload a node takes: an
    offer above it is refused (``oversized``, not retryable) and ZeroMQ refuses a larger
    message before allocating it (``MAXMSGSIZE``, :attr:`max_message_bytes`).  A fleet derives
    it from its catalog and bucket size (:func:`~dcr.adapters.transport.relay.sizing.
    largest_payload`) unless the fleet file sets it.  A node holds at most ``max_buffered``
    payloads and ``max_buffered_bytes`` bytes, granted room included (one payload is always
    admitted into an empty buffer, so the byte bound is at least one payload); a receiver holds
    at most ``receiver_window`` deliveries it has not taken yet (a count only: the receiver
    engine keeps one of them free for the payload its declared order needs next, so a byte
    bound there could stall it).  ``hwm`` is ZeroMQ's SNDHWM/RCVHWM in messages; windows keep
    payload frames far below it.

    **Per peer.**  A *peer* is one key (with keys) or one connection (a routing id, without):

    * ``max_peer_offers``: offers it may have waiting or granted at once;
    * ``max_peer_granted_bytes``: room it may hold granted (a peer holding none may always be
      granted one payload); its further offers wait without holding up other peers';
    * ``max_peer_ungranted_bytes``: data bytes it may send without a grant (refused before
      they are queued) per ``peer_timeout_s``; ``None``: twice the room it may hold;
    * ``max_peer_drops``: frames of it a node may drop (malformed, wrong role, unknown,
      replayed, ...) per ``peer_timeout_s``;
    * ``grant_timeout_s``: a granted offer whose data has not arrived this long after the
      grant or the peer's last data (pings are no progress; behind an emulated link, plus the
      payload's link time) is reclaimed and counted (``grants_expired``).

    A peer over any of these bounds, or whose grant expired, is *refused*: ZeroMQ cannot
    disconnect one peer, so its state is dropped (waiting offers, granted room, links), it is
    counted in ``peers_refused`` (by reason) and its frames are ignored for
    ``peer_cooloff_s``.  So one peer holds at most :attr:`peer_held_bytes` of a node's
    buffer, for at most ``grant_timeout_s`` without progress, plus its waiting offers'
    headers (``max_peer_offers * max_offer_header_bytes``).

    **Per node.**  At most ``max_waiting_offers`` offers wait in all (a further one is refused
    as ``busy``, retryable); an offer's header (its recipient list) is at most
    ``max_offer_header_bytes``; a node tracks at most ``max_peers`` peers.
    """

    max_payload_bytes: int = 1 << 30
    max_buffered: int = 32
    max_buffered_bytes: int = 1 << 30
    receiver_window: int = 8
    ping_interval_s: float = 0.25
    peer_timeout_s: float = 3.0
    hwm: int = 10_000
    link_gbps: float | None = None
    grant_timeout_s: float = 10.0
    max_peer_offers: int = 64
    max_peer_granted_bytes: int = 512 << 20
    max_peer_ungranted_bytes: int | None = None
    max_peer_drops: int = 256
    peer_cooloff_s: float = 10.0
    max_waiting_offers: int = 4096
    max_offer_header_bytes: int = 64 << 10
    max_peers: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_payload_bytes",
            "max_buffered",
            "max_buffered_bytes",
            "receiver_window",
            "max_peer_offers",
            "max_peer_granted_bytes",
            "max_peer_drops",
            "max_waiting_offers",
            "max_offer_header_bytes",
            "max_peers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"relay {name} must be an integer >= 1, got {value!r}")
        ungranted = self.max_peer_ungranted_bytes
        if ungranted is not None and (
            isinstance(ungranted, bool) or not isinstance(ungranted, int) or ungranted < 0
        ):
            raise ConfigError(
                f"relay max_peer_ungranted_bytes must be an integer >= 0 or unset, "
                f"got {ungranted!r}"
            )
        if not 0 < self.ping_interval_s < self.peer_timeout_s:
            raise ConfigError("relay ping_interval_s must be positive and below peer_timeout_s")
        for name in ("grant_timeout_s", "peer_cooloff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"relay {name} must be positive")
        if self.hwm < 4 * max(self.max_buffered, self.receiver_window):
            raise ConfigError("relay hwm must be at least 4x the largest window")
        if self.link_gbps is not None and self.link_gbps < 0:
            raise ConfigError("relay link_gbps must be >= 0 (0 or None: no limit)")

    @property
    def max_message_bytes(self) -> int:
        """ZeroMQ ``MAXMSGSIZE``: a larger frame is refused before it is allocated."""
        return self.max_payload_bytes + HEADER_LIMIT

    @property
    def peer_room_bytes(self) -> int:
        """The most granted room one peer can hold: ``max_peer_granted_bytes``, or one
        payload (a peer holding no room is always granted one)."""
        return max(self.max_peer_granted_bytes, self.max_payload_bytes)

    @property
    def peer_held_bytes(self) -> int:
        """The most payload bytes one peer can make a node hold: its room
        (:attr:`peer_room_bytes`), within the buffer's bounds (``max_buffered`` payloads of
        at most ``max_payload_bytes``, ``max_buffered_bytes`` or one payload)."""
        buffer = max(self.max_buffered_bytes, self.max_payload_bytes)
        return min(self.peer_room_bytes, self.max_buffered * self.max_payload_bytes, buffer)

    @property
    def peer_ungranted_bytes(self) -> int:
        """``max_peer_ungranted_bytes``, or twice :attr:`peer_room_bytes` when unset: data
        in flight when a stop revokes a peer's grants arrives ungranted, at most its room."""
        if self.max_peer_ungranted_bytes is not None:
            return self.max_peer_ungranted_bytes
        return 2 * self.peer_room_bytes


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
