"""A relay node's state (paper §7.1, App. B "Transports"): its links downwards with their
credit windows, the transfers and stop waves it waits on, the owners' connections at the root,
what each peer holds against its bounds, its buffer accounting, the sends every handler uses,
and its public view.

:class:`NodeState` is the base of :class:`~dcr.adapters.transport.relay.node.RelayNode`; the
handlers build on it in layers: ``forwarding`` (delivery down the tree: transfers, ACKs, stop
and cleanup waves), ``grants`` (the root's admission of owners' payloads), ``guard`` (per-peer
bounds, grant timeouts, refusing a peer) and ``node`` (serving, dispatch, membership and
liveness).
"""

from __future__ import annotations

import itertools
import secrets
from collections import Counter, deque
from dataclasses import dataclass, field

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.security import Security, auth_counts
from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay.config import Held, RelayConfig
from dcr.adapters.transport.relay.frames import Data, Frame, Offer, Refused, Sized, encode
from dcr.adapters.transport.relay.sockets import NODE, node_identity, routing_id, send_now
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Arrival", "Budget", "Client", "Granted", "Link", "NodeState", "Transfer", "Wave"]


@dataclass(slots=True, eq=False)
class Budget:
    """What one peer (one key with keys, one connection without) holds against its bounds
    (:class:`~dcr.adapters.transport.relay.config.RelayConfig`, "Per peer")."""

    key: str
    since: float
    """Start of the current ``peer_timeout_s`` window of :attr:`drops` and :attr:`ungranted`."""
    progress: float
    """When its data last arrived (or its first grant was made): grants expire from here."""
    offers: int = 0
    """Its offers waiting or granted."""
    granted_bytes: int = 0
    """Room granted to it whose data has not arrived yet, or waits for the root's emulated
    link."""
    drops: int = 0
    ungranted: int = 0
    users: int = 0
    """Its clients and links at this node (a budget without users is forgotten)."""
    over: str | None = None
    """Set by a handler when the peer went over a bound (the reason); the peer is refused."""


@dataclass(slots=True, eq=False)
class Link:
    """A child node or a receiver below this node, with its credit window."""

    ident: bytes
    role: bytes
    name: str
    """The child node's or receiver's name (its key's, or its routing id's without keys)."""
    budget: Budget
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
    """An owner's or the coordinator's connection (offers are taken at the root only)."""

    ident: bytes
    heard: float
    budget: Budget
    last_seq: int = 0
    granted: set[int] = field(default_factory=set)
    offers: int = 0
    """Its offers waiting or granted (its share of :attr:`Budget.offers`)."""


@dataclass(slots=True, eq=False)
class Granted:
    """Root only: room granted to a client's offer, waiting for its data."""

    offer: Offer
    at: float


@dataclass(slots=True, eq=False)
class Arrival:
    """Root only, behind an emulated link: granted data waiting to pass the root's link."""

    client: Client
    frame: Data
    body: Sized
    offer: Offer
    dropped: bool = False
    """Released meanwhile (its attempt stopped, its client forgotten): not taken."""


class NodeState:
    """What one relay node holds and knows, and the primitives its handlers share (see
    :class:`~dcr.adapters.transport.relay.node.RelayNode` for the arguments)."""

    def __init__(
        self,
        name: str,
        *,
        bind: str = "tcp://127.0.0.1:0",
        parent: str | None = None,
        parent_name: str | None = None,
        config: RelayConfig | None = None,
        context: zmq.asyncio.Context | None = None,
        security: Security | None = None,
    ) -> None:
        self.name = name
        self.bind = bind
        self.parent = parent
        self.parent_name = parent_name
        self.config = config or RelayConfig()
        self.security = security or Security()
        self.identity = node_identity(name) if self.security.keyed else None
        """``relay:<name>`` with keys: the node's server key and its parent link's key."""
        if self.security.keyed and parent is not None and parent_name is None:
            raise ConfigError(
                f"relay node {name}: with keys, a node needs its parent's name (parent_name) "
                "to check its parent's key"
            )
        self.ident = routing_id(NODE, name)
        self.nonce = secrets.randbits(63) | 1
        self.drops: Counter[str] = Counter()
        self.peers_lost = 0
        self.peers_refused: Counter[str] = Counter()
        """Peers refused (logically disconnected) per reason: ``offers``, ``granted``,
        ``ungranted``, ``drops``, ``grant-timeout``."""
        self.grants_expired = 0
        """Granted offers reclaimed because their data did not come in time."""
        self._context = context
        self._zmq: zmq.asyncio.Context | None = None
        self._address: str | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._links: dict[bytes, Link] = {}
        self._named: dict[tuple[bytes, str], bytes] = {}
        """(role, name) -> the routing id of that name's newest link."""
        self._budgets: dict[str, Budget] = {}
        self._cooloff: dict[str, float] = {}
        """Refused peers' keys -> until when their frames are ignored."""
        self._admit_due = False
        """Something changed that may let a waiting offer in."""
        self._transfers: dict[int, Transfer] = {}
        self._waves: dict[int, Wave] = {}
        self._stopped: set[int] = set()
        self._count = self._bytes = self._peak_count = self._peak_bytes = self._largest = 0
        self._seq = itertools.count(1)
        self._clients: dict[bytes, Client] = {}
        self._offers: deque[tuple[bytes, Offer]] = deque()
        self._unheard: dict[tuple[bytes, int], float] = {}
        """Waiting offers addressed only to receivers not subscribed in the tree (yet) -> since
        when (monotonic): they wait up to ``peer_timeout_s`` for one to subscribe."""
        self._granted: dict[tuple[bytes, int], Granted] = {}
        self._seen: dict[PayloadKey, int] = {}
        self._stats = TransportStats()
        self._by_attempt: dict[int, list[int]] = {}
        self._last_payload = (0, 0)
        self._last_wave = (0, 0)
        self._announced: frozenset[str] | None = None
        self.ingress = LinkLimit(self.config.link_gbps)
        """The root's side of the cross-cluster link: payload bytes from owners pass it in
        arrival order before the root takes them (``link_gbps``; unlimited by default)."""
        self._arrivals: deque[Arrival] = deque()
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

    def auth(self) -> Counter[str]:
        """ZAP decisions at this node's ROUTER while it serves (``allowed``, ``denied``
        connections); empty without keys."""
        return auth_counts(self._zmq) if self._zmq is not None else Counter()

    def peers(self) -> dict[str, str]:
        """Peers this node knows, by key (``owner:o0`` with keys, ``id:<routing id>``
        without): ``client``, ``node`` (a child) or ``receiver``."""
        out = {c.budget.key: "client" for c in self._clients.values()}
        for link in self._links.values():
            out[link.budget.key] = "node" if link.role == NODE else "receiver"
        return out

    def waiting_offers(self) -> dict[str, int]:
        """At the root: offers waiting or granted, per peer (its key)."""
        return {k: b.offers for k, b in self._budgets.items() if b.offers}

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
        self._admit_due = True

    def _fits(self, size: int) -> bool:
        if self._count == 0:
            return True
        if self._count >= self.config.max_buffered:
            return False
        return self._bytes + size <= self.config.max_buffered_bytes

    # -- what each peer holds -----------------------------------------------------------------

    def _budget(self, key: str, now: float) -> Budget | None:
        """The budget of peer ``key`` (``None``: the node tracks ``max_peers`` already)."""
        budget = self._budgets.get(key)
        if budget is None:
            if len(self._budgets) >= self.config.max_peers:
                return None
            budget = self._budgets[key] = Budget(key=key, since=now, progress=now)
        return budget

    def _offer_gone(self, ident: bytes) -> None:
        """One offer of client ``ident`` left the waiting queue or its grant."""
        client = self._clients.get(ident)
        if client is not None:
            client.offers -= 1
            client.budget.offers -= 1
        self._admit_due = True

    def _take_grant(self, ident: bytes, seq: int) -> Granted | None:
        """Remove the grant of client ``ident``'s request ``seq``; its room stays held (the
        caller releases it, or the data it was granted for takes it over)."""
        granted = self._granted.pop((ident, seq), None)
        if granted is not None:
            client = self._clients.get(ident)
            if client is not None:
                client.granted.discard(seq)
                client.budget.granted_bytes -= granted.offer.size
            self._offer_gone(ident)
        return granted

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
