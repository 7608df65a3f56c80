"""A relay node's state (paper §7.1, App. B "Transports"): its links downwards with their
credit windows, the transfers and stop waves it waits on, the owners' connections at the root,
its buffer accounting, the sends every handler uses, and its public view.

:class:`NodeState` is the base of :class:`~dcr.adapters.transport.relay.node.RelayNode`; the
handlers build on it in layers: ``forwarding`` (delivery down the tree: transfers, ACKs, stop
and cleanup waves), ``grants`` (the root's admission of owners' payloads) and ``node``
(serving, dispatch, membership and liveness).
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, deque
from dataclasses import dataclass, field

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay.config import Held, RelayConfig
from dcr.adapters.transport.relay.frames import Data, Frame, Offer, Refused, Sized, encode
from dcr.adapters.transport.relay.sockets import NODE, routing_id, send_now
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Client", "Link", "NodeState", "Transfer", "Wave"]


@dataclass(slots=True, eq=False)
class Link:
    """A child node or a receiver below this node, with its credit window."""

    ident: bytes
    nonce: int
    capacity: int
    capacity_bytes: int
    receivers: frozenset[str]
    heard: float
    queue: deque[int] = field(default_factory=deque)
    """Transfers routed to this link that wait for credit."""
    inflight: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Transfer id -> (attempt, size), sent and not acknowledged."""
    inflight_bytes: int = 0

    def has_credit(self, size: int) -> bool:
        if len(self.inflight) >= self.capacity:
            return False
        return not self.inflight or self.inflight_bytes + size <= self.capacity_bytes


@dataclass(slots=True, eq=False)
class Transfer:
    """One payload this node holds until every link it went to acknowledged it."""

    seq: int
    origin: int
    key: PayloadKey
    to: frozenset[str] | None
    body: Sized
    size: int
    client: tuple[bytes, int] | None
    """Root only: the owner's routing id and request number to answer ``DELIVERED`` to."""
    waiting: set[bytes] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Wave:
    """A stop or cleanup of one attempt travelling down; done when every link confirmed."""

    seq: int
    attempt: int
    client: tuple[bytes, int] | None
    waiting: set[bytes] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class Client:
    """Root only: an owner's or the coordinator's connection."""

    ident: bytes
    heard: float
    last_seq: int = 0
    granted: set[int] = field(default_factory=set)


class NodeState:
    """What one relay node holds and knows, and the primitives its handlers share (see
    :class:`~dcr.adapters.transport.relay.node.RelayNode` for the arguments)."""

    def __init__(
        self,
        name: str,
        *,
        bind: str = "tcp://127.0.0.1:0",
        parent: str | None = None,
        config: RelayConfig | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.name = name
        self.bind = bind
        self.parent = parent
        self.config = config or RelayConfig()
        self.ident = routing_id(NODE, name)
        self.nonce = secrets.randbits(63) | 1
        self.drops: Counter[str] = Counter()
        self.peers_lost = 0
        self._context = context
        self._address: str | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._links: dict[bytes, Link] = {}
        self._transfers: dict[int, Transfer] = {}
        self._waves: dict[int, Wave] = {}
        self._stopped: set[int] = set()
        self._count = self._bytes = self._peak_count = self._peak_bytes = self._largest = 0
        self._seq = itertools.count(1)
        self._clients: dict[bytes, Client] = {}
        self._offers: deque[tuple[bytes, Offer]] = deque()
        self._granted: dict[tuple[bytes, int], Offer] = {}
        self._seen: dict[PayloadKey, int] = {}
        self._stats = TransportStats()
        self._by_attempt: dict[int, list[int]] = {}
        self._last_payload = (0, 0)
        self._last_wave = (0, 0)
        self._announced: frozenset[str] | None = None
        self.ingress = LinkLimit(self.config.link_gbps)
        """The root's side of the cross-cluster link: payload bytes from owners pass it in
        arrival order before the root takes them (``link_gbps``; unlimited by default)."""
        self._arrivals: deque[tuple[bytes, Data, Sized]] = deque()
        self._arrived = anyio.Event()

    # -- public view ------------------------------------------------------------------------

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def address(self) -> str:
        """The bound address (after :meth:`serve` started)."""
        if self._address is None:
            raise TransportError(f"relay node {self.name} is not serving", retryable=True)
        return self._address

    def stats(self) -> TransportStats:
        """At the root: V_cross (every payload byte received from owners, every copy) and
        V_payload (each ``(attempt, owner, payload id)`` once) -- paper §7.1; zero elsewhere."""
        return self._stats

    def attempt_traffic(self) -> dict[int, tuple[int, int]]:
        """At the root, per attempt (the latest 1024): ``(V_cross, V_payload)`` in bytes."""
        return {a: (c[0], c[1]) for a, c in self._by_attempt.items()}

    def held(self) -> Held:
        """Payloads this node holds (the root counts room it granted as held)."""
        return Held(
            count=self._count,
            bytes=self._bytes,
            peak_count=self._peak_count,
            peak_bytes=self._peak_bytes,
            max_count=self.config.max_buffered,
            max_bytes=max(self.config.max_buffered_bytes, self._largest),
        )

    def receivers(self) -> frozenset[str]:
        """Receivers subscribed in this node's subtree."""
        out: set[str] = set()
        for link in self._links.values():
            out |= link.receivers
        return frozenset(out)

    # -- sending ----------------------------------------------------------------------------

    def _emit(self, ident: bytes, frame: Frame, body: Sized | None = None) -> bool:
        assert self._router is not None
        parts: list[bytes | Sized] = [ident, encode(frame)]
        if body is not None:
            parts.append(body)
        return send_now(self._router, parts)

    def _up(self, frame: Frame) -> None:
        if self._dealer is not None and not send_now(self._dealer, [encode(frame)]):
            self.drops["unsent"] += 1

    def _reply(self, ident: bytes, frame: Frame) -> None:
        if not self._emit(ident, frame):
            self._forget_client(ident)

    def _refuse(self, ident: bytes, seq: int, check: str, reason: str, retryable: bool) -> None:
        self._reply(ident, Refused(seq=seq, retryable=retryable, check=check, reason=reason))

    # -- buffer accounting ------------------------------------------------------------------

    def _hold(self, count: int, size: int) -> None:
        self._count += count
        self._bytes += size
        self._peak_count = max(self._peak_count, self._count)
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._largest = max(self._largest, size)

    def _release(self, count: int, size: int) -> None:
        self._count -= count
        self._bytes -= size

    def _fits(self, size: int) -> bool:
        if self._count == 0:
            return True
        if self._count >= self.config.max_buffered:
            return False
        return self._bytes + size <= self.config.max_buffered_bytes

    def _replayed(self, attr: str, origin: int, seq: int) -> bool:
        last_origin, last_seq = getattr(self, attr)
        if origin == last_origin and seq <= last_seq:
            self.drops["replayed"] += 1
            return True
        setattr(self, attr, (origin, seq))
        return False

    # -- handlers of the layers above -------------------------------------------------------

    def _forget_client(self, ident: bytes) -> None:
        """The client vanished (defined with the root's grants)."""
        raise NotImplementedError

    def _lose(self, link: Link) -> None:
        """A link vanished (defined with the node's membership)."""
        raise NotImplementedError
