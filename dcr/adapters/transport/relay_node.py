"""Relay nodes of the relay-tree transport (paper §7.1, App. B "Transports").

Owners stream payloads to one *root* node on the rollout side; the root forwards them over a
balanced tree of relay nodes, each node hands them to the receivers it hosts, and queueing ACKs
flow back up.  A node's links downwards (child nodes and its receivers) each get at most a
window of unacknowledged transfers; a child advertises its window (its own buffer bound) when
it joins, a receiver when it subscribes.  A transfer leaves a node's buffer only once every link
it went to acknowledged it, so a slow receiver fills its node's buffer, then its parent's, and
finally the root stops granting owners room: owners slow down and no buffer grows past its bound.

Liveness without libzmq's draft API: ROUTER sockets use ``ROUTER_MANDATORY`` (sending to a
vanished peer fails at once with ``EHOSTUNREACH``) and ``ROUTER_HANDOVER`` (a restarted peer
with the same routing id takes over); every node pings its links each ``ping_interval_s``, and
children and receivers repeat their ``JOIN`` / ``SUBSCRIBE`` as heartbeats, so a link silent for
``peer_timeout_s`` is dropped too.  Dropping a link drops everything waited for on it.

A node's state changes only in synchronous handlers that run between awaits; sends never block
(``NOBLOCK``), so handlers never interleave.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay_wire import (
    HEADER_LIMIT,
    Ack,
    Answer,
    Cancel,
    Data,
    Delivered,
    Done,
    Frame,
    FrameError,
    Grant,
    Join,
    Offer,
    Payload,
    Ping,
    Pong,
    Query,
    Refused,
    Sized,
    Stop,
    Subscribe,
    Unsubscribe,
    decode,
    encode,
)
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Held", "RelayConfig", "RelayNode", "balanced_tree", "start_tree"]

CLIENT, NODE, RECEIVER = b"c:", b"n:", b"r:"
"""Routing-id prefixes: a peer's role is part of its routing id."""


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


def routing_id(prefix: bytes, name: str) -> bytes:
    """A peer's ZeroMQ routing id (at most 255 bytes)."""
    ident = prefix + name.encode()
    if not name or len(ident) > 255:
        raise ConfigError(f"relay peer name {name!r} must be 1 to 253 UTF-8 bytes")
    return ident


def set_common_options(sock: zmq.asyncio.Socket, config: RelayConfig) -> None:
    """Options every relay socket shares: no linger, high-water marks, the frame-size limit."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.hwm)
    sock.setsockopt(zmq.RCVHWM, config.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)


def send_now(sock: zmq.asyncio.Socket, parts: Sequence[bytes | Sized]) -> bool:
    """Send without waiting; ``False`` if the peer is gone or its queue is full.

    Relay nodes and subscriptions never wait on a send, so pyzmq completes a ``NOBLOCK`` send
    at once (with ``EHOSTUNREACH`` under ``ROUTER_MANDATORY`` when the peer vanished).
    """
    future = cast(
        "asyncio.Future[object]", sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
    )
    if not future.done():
        future.cancel()
        raise TransportError("a relay send did not complete at once", retryable=True)
    exc = future.exception()
    if exc is None:
        return True
    if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
        return False
    raise TransportError(f"relay send failed: {exc}", retryable=True) from exc


def decode_frames(parts: Sequence[zmq.Frame], *, max_size: int) -> tuple[Frame, Sized | None]:
    """Check a received message (routing id removed); the header's length is checked
    before its bytes are copied out of the ZeroMQ frame."""
    if not parts:
        raise FrameError("an empty message", check="parts")
    if len(parts[0]) > HEADER_LIMIT:
        raise FrameError("header larger than HEADER_LIMIT", check="oversized")
    return decode(parts[0].bytes, parts[1:], max_size=max_size)


@dataclass(slots=True, eq=False)
class _Link:
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
class _Transfer:
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
class _Wave:
    """A stop or cleanup of one attempt travelling down; done when every link confirmed."""

    seq: int
    attempt: int
    client: tuple[bytes, int] | None
    waiting: set[bytes] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class _Client:
    """Root only: an owner's or the coordinator's connection."""

    ident: bytes
    heard: float
    last_seq: int = 0
    granted: set[int] = field(default_factory=set)


class RelayNode:
    """One relay node: a ROUTER that children, receivers and (at the root) owners connect to,
    plus a DEALER to its parent unless it is the root.

    ``bind`` ending in ``:0`` picks a free port; :attr:`address` is the bound address once
    :meth:`serve` started.  ``drops`` counts frames dropped per reason (``truncated``,
    ``magic``, ``version``, ``kind``, ``malformed``, ``parts``, ``oversized``, ``replayed``,
    ``unknown``, ``role``, ``direction``, ``stopped``, ``overflow``, ``unsent``); a bad frame
    changes nothing else; ``peers_lost`` counts links dropped as vanished.  Serve each node
    object once.
    """

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
        self._links: dict[bytes, _Link] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._waves: dict[int, _Wave] = {}
        self._stopped: set[int] = set()
        self._count = self._bytes = self._peak_count = self._peak_bytes = self._largest = 0
        self._seq = itertools.count(1)
        self._clients: dict[bytes, _Client] = {}
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

    # -- service ----------------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind, join the parent, and relay until cancelled."""
        own = self._context is None
        ctx = self._context or zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        dealer: zmq.asyncio.Socket | None = None
        try:
            set_common_options(router, self.config)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._address = _bind(router, self.bind)
            self._router = router
            if self.parent is not None:
                dealer = ctx.socket(zmq.DEALER)
                set_common_options(dealer, self.config)
                dealer.setsockopt(zmq.ROUTING_ID, self.ident)
                try:
                    dealer.connect(self.parent)
                except zmq.ZMQError as exc:
                    raise TransportError(
                        f"relay node {self.name} cannot reach its parent {self.parent}: {exc}",
                        retryable=False,
                        check="config",
                    ) from exc
                self._dealer = dealer
                self._announce(force=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_router, router)
                if dealer is not None:
                    tg.start_soon(self._read_parent, dealer)
                tg.start_soon(self._tick_forever)
                if self.ingress.bytes_per_s is not None:
                    tg.start_soon(self._ingress_forever)
                task_status.started()
        finally:
            self._router = self._dealer = None
            router.close(linger=0)
            if dealer is not None:
                dealer.close(linger=0)
            if own:
                ctx.term()

    async def _read_router(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._on_router(await _receive(sock, self.name))

    async def _read_parent(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._on_parent(await _receive(sock, self.name))

    async def _ingress_forever(self) -> None:
        """Take payload bytes from owners through the emulated link, one transfer after the
        other in arrival order; control frames do not wait behind them."""
        while True:
            while not self._arrivals:
                self._arrived = anyio.Event()
                await self._arrived.wait()
            ident, frame, body = self._arrivals[0]
            await self.ingress.pace(frame.size)
            self._arrivals.popleft()
            client = self._clients.get(ident)
            if client is None:
                # Forgotten meanwhile: the room it was granted is released; tell it, as for
                # data that arrives after its client was forgotten.
                client = _Client(ident=ident, heard=time.monotonic())
            self._on_data(client, frame, body)
            self._admit()

    async def _tick_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.ping_interval_s)
            self._tick(time.monotonic())

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

    # -- dispatch ---------------------------------------------------------------------------

    def _decode(self, parts: Sequence[zmq.Frame]) -> tuple[Frame, Sized | None] | None:
        try:
            return decode_frames(parts, max_size=self.config.max_payload_bytes)
        except FrameError as exc:
            self.drops[exc.check or "malformed"] += 1
            return None

    def _on_router(self, parts: Sequence[zmq.Frame]) -> None:
        ident = parts[0].bytes
        got = self._decode(parts[1:])
        if got is None:
            return
        frame, body = got
        role = ident[:2]
        now = time.monotonic()
        if role == CLIENT and isinstance(frame, Offer | Data | Cancel | Stop | Query | Ping):
            self._on_client(ident, frame, body, now)
        elif role in (NODE, RECEIVER) and isinstance(frame, Ack | Done):
            link = self._links.get(ident)
            if link is None:
                self.drops["unknown"] += 1
            elif isinstance(frame, Ack):
                link.heard = now
                self._on_ack(link, frame.seq)
            else:
                link.heard = now
                self._on_done(link, frame.seq)
        elif role == RECEIVER and isinstance(frame, Subscribe | Unsubscribe):
            self._on_subscribe(ident, frame, now)
        elif role == NODE and isinstance(frame, Join):
            self._on_join(ident, frame, now)
        elif isinstance(frame, Grant | Delivered | Refused | Payload | Pong | Answer):
            self.drops["direction"] += 1
        else:
            self.drops["role"] += 1
        self._admit()

    def _on_parent(self, parts: Sequence[zmq.Frame]) -> None:
        got = self._decode(parts)
        if got is None:
            return
        frame, body = got
        if isinstance(frame, Payload):
            assert body is not None
            self._on_payload(frame, body)
        elif isinstance(frame, Stop):
            if self._replayed("_last_wave", frame.origin, frame.seq):
                return
            self._start_wave(frame.attempt, frame.cleanup, frame.origin, frame.seq, None)
        elif isinstance(frame, Ping):
            pass  # the parent's liveness probe
        else:
            self.drops["direction"] += 1

    def _replayed(self, attr: str, origin: int, seq: int) -> bool:
        last_origin, last_seq = getattr(self, attr)
        if origin == last_origin and seq <= last_seq:
            self.drops["replayed"] += 1
            return True
        setattr(self, attr, (origin, seq))
        return False

    # -- owners and the coordinator (root) --------------------------------------------------

    def _on_client(self, ident: bytes, frame: Frame, body: Sized | None, now: float) -> None:
        client = self._clients.get(ident)
        if client is None:
            client = self._clients[ident] = _Client(ident=ident, heard=now)
        client.heard = now
        if isinstance(frame, Ping):
            self._reply(ident, Pong(nonce=self.nonce))
            return
        if isinstance(frame, Data):
            assert body is not None
            if self.ingress.bytes_per_s is not None:
                self._arrivals.append((ident, frame, body))
                self._arrived.set()
                return
            self._on_data(client, frame, body)
            return
        if isinstance(frame, Cancel):
            offer = self._granted.pop((ident, frame.seq), None)
            if offer is None:
                before = len(self._offers)
                self._offers = deque(
                    (i, o) for i, o in self._offers if (i, o.seq) != (ident, frame.seq)
                )
                if len(self._offers) == before:
                    self.drops["unknown"] += 1
            else:
                client.granted.discard(frame.seq)
                self._release(1, offer.size)
            return
        assert isinstance(frame, Offer | Stop | Query)
        if frame.seq <= client.last_seq:
            self.drops["replayed"] += 1
            return
        client.last_seq = frame.seq
        if isinstance(frame, Query):
            self._reply(
                ident,
                Answer(
                    seq=frame.seq,
                    receivers=self.receivers(),
                    payloads=self._stats.payloads,
                    payload_bytes=self._stats.payload_bytes,
                    cross_bytes=self._stats.cross_bytes,
                ),
            )
        elif not self.is_root:
            self._refuse(ident, frame.seq, "not-root", f"{self.name} is not the root", False)
        elif isinstance(frame, Stop):
            wave = next(self._seq)
            self._start_wave(frame.attempt, frame.cleanup, self.nonce, wave, (ident, frame.seq))
        elif frame.key.attempt in self._stopped:
            self._refuse(ident, frame.seq, "stopped", "the attempt was stopped", False)
        elif frame.size > self.config.max_payload_bytes:
            limit = self.config.max_payload_bytes
            self._refuse(ident, frame.seq, "oversized", f"payload above {limit} bytes", False)
        else:
            self._offers.append((ident, frame))

    def _fits(self, size: int) -> bool:
        if self._count == 0:
            return True
        if self._count >= self.config.max_buffered:
            return False
        return self._bytes + size <= self.config.max_buffered_bytes

    def _admit(self) -> None:
        """Grant room to waiting offers in arrival order while the buffer has room."""
        while self._offers and self._fits(self._offers[0][1].size):
            ident, offer = self._offers.popleft()
            client = self._clients.get(ident)
            if client is None:
                continue
            self._granted[(ident, offer.seq)] = offer
            client.granted.add(offer.seq)
            self._hold(1, offer.size)
            self._reply(ident, Grant(seq=offer.seq))

    def _on_data(self, client: _Client, frame: Data, body: Sized) -> None:
        s = self._stats
        self._stats = TransportStats(
            payloads=s.payloads,
            payload_bytes=s.payload_bytes,
            cross_bytes=s.cross_bytes + frame.size,
        )
        offer = self._granted.pop((client.ident, frame.seq), None)
        if offer is None:
            # Room this root never granted, or released meanwhile (a client silent for
            # peer_timeout_s): the sender, if it still waits, retries in a new attempt.
            self.drops["unknown"] += 1
            self._refuse(client.ident, frame.seq, "lost", "no room was granted for it", True)
            return
        client.granted.discard(frame.seq)
        counts = self._by_attempt.setdefault(offer.key.attempt, [0, 0])
        counts[0] += frame.size
        while len(self._by_attempt) > 1024:
            del self._by_attempt[next(iter(self._by_attempt))]
        if offer.size != frame.size:
            self._release(1, offer.size)
            self.drops["malformed"] += 1
            self._refuse(client.ident, frame.seq, "size", "data size differs from offer", False)
            return
        if offer.key not in self._seen:
            self._seen[offer.key] = frame.size
            counts[1] += frame.size
            s = self._stats
            self._stats = TransportStats(
                payloads=s.payloads + 1,
                payload_bytes=s.payload_bytes + frame.size,
                cross_bytes=s.cross_bytes,
            )
        t = _Transfer(
            seq=next(self._seq),
            origin=self.nonce,
            key=offer.key,
            to=offer.to,
            body=body,
            size=frame.size,
            client=(client.ident, frame.seq),
        )
        self._route(t)

    def _forget_client(self, ident: bytes) -> None:
        """The client vanished: release room granted to it and drop its waiting offers."""
        client = self._clients.pop(ident, None)
        if client is None:
            return
        for seq in client.granted:
            offer = self._granted.pop((ident, seq), None)
            if offer is not None:
                self._release(1, offer.size)
        self._offers = deque((i, o) for i, o in self._offers if i != ident)

    # -- transfers --------------------------------------------------------------------------

    def _hold(self, count: int, size: int) -> None:
        self._count += count
        self._bytes += size
        self._peak_count = max(self._peak_count, self._count)
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._largest = max(self._largest, size)

    def _release(self, count: int, size: int) -> None:
        self._count -= count
        self._bytes -= size

    def _on_payload(self, frame: Payload, body: Sized) -> None:
        if self._replayed("_last_payload", frame.origin, frame.seq):
            return
        if frame.key.attempt in self._stopped or not self._fits(frame.size):
            # Nothing to deliver (stopped) or a parent that ignored this node's window: the
            # transfer ends here; the receivers' arrival check reports what is missing.
            self.drops["stopped" if frame.key.attempt in self._stopped else "overflow"] += 1
            self._up(Ack(seq=frame.seq))
            return
        self._hold(1, frame.size)
        t = _Transfer(
            seq=frame.seq,
            origin=frame.origin,
            key=frame.key,
            to=frame.to,
            body=body,
            size=frame.size,
            client=None,
        )
        self._route(t)

    def _route(self, t: _Transfer) -> None:
        """Queue ``t`` on every link with an addressed receiver below it; hold it until all ACK."""
        targets = [
            link
            for link in self._links.values()
            if (link.receivers if t.to is None else link.receivers & t.to)
        ]
        self._transfers[t.seq] = t
        t.waiting = {link.ident for link in targets}
        if not targets:
            self._complete(t)
            return
        for link in targets:
            link.queue.append(t.seq)
        for link in targets:
            self._pump(link)

    def _pump(self, link: _Link) -> None:
        """Send queued transfers to ``link`` while its window has room."""
        while link.queue and self._links.get(link.ident) is link:
            t = self._transfers.get(link.queue[0])
            if t is None or link.ident not in t.waiting:
                link.queue.popleft()
                continue
            if not link.has_credit(t.size):
                return
            frame = Payload(origin=t.origin, seq=t.seq, key=t.key, size=t.size, to=t.to)
            if not self._emit(link.ident, frame, t.body):
                # The peer is gone: losing the link releases every transfer waiting for it,
                # this one included (it is still at the head of the queue).
                self._lose(link)
                return
            link.queue.popleft()
            link.inflight[t.seq] = (t.key.attempt, t.size)
            link.inflight_bytes += t.size

    def _complete(self, t: _Transfer) -> None:
        if self._transfers.pop(t.seq, None) is None:
            return
        self._release(1, t.size)
        if t.client is None:
            self._up(Ack(seq=t.seq))
        else:
            self._reply(t.client[0], Delivered(seq=t.client[1]))

    def _on_ack(self, link: _Link, seq: int) -> None:
        entry = link.inflight.pop(seq, None)
        if entry is None:
            self.drops["unknown"] += 1
            return
        link.inflight_bytes -= entry[1]
        t = self._transfers.get(seq)
        if t is not None and link.ident in t.waiting:
            t.waiting.discard(link.ident)
            if not t.waiting:
                self._complete(t)
        self._pump(link)

    # -- stop and cleanup -------------------------------------------------------------------

    def _start_wave(
        self,
        attempt: int,
        cleanup: bool,
        origin: int,
        seq: int,
        client: tuple[bytes, int] | None,
    ) -> None:
        """Stop ``attempt`` here and below: drop what this node holds of it, refuse it from
        now on, and confirm once every link confirmed (paper App. B.2, stopping an attempt)."""
        self._stopped.add(attempt)
        if cleanup:
            self._seen = {k: v for k, v in self._seen.items() if k.attempt != attempt}
        for t in [t for t in self._transfers.values() if t.key.attempt == attempt]:
            del self._transfers[t.seq]
            self._release(1, t.size)
            if t.client is not None:
                self._refuse(t.client[0], t.client[1], "stopped", "the attempt was stopped", False)
        for key in [k for k, o in self._granted.items() if o.key.attempt == attempt]:
            offer = self._granted.pop(key, None)
            if offer is None:
                continue
            self._release(1, offer.size)
            c = self._clients.get(key[0])
            if c is not None:
                c.granted.discard(key[1])
            self._refuse(key[0], key[1], "stopped", "the attempt was stopped", False)
        waiting = [(i, o) for i, o in self._offers if o.key.attempt == attempt]
        self._offers = deque((i, o) for i, o in self._offers if o.key.attempt != attempt)
        for ident, offer in waiting:
            self._refuse(ident, offer.seq, "stopped", "the attempt was stopped", False)
        wave = _Wave(seq=seq, attempt=attempt, client=client)
        frame = Stop(origin=origin, seq=seq, attempt=attempt, cleanup=cleanup)
        lost = []
        for link in list(self._links.values()):
            if self._emit(link.ident, frame):
                wave.waiting.add(link.ident)
            else:
                lost.append(link)
        self._waves[seq] = wave
        for link in lost:
            self._lose(link)
        if not wave.waiting:
            self._finish(wave)

    def _finish(self, wave: _Wave) -> None:
        if self._waves.pop(wave.seq, None) is None:
            return
        if wave.client is None:
            self._up(Done(seq=wave.seq))
        else:
            self._reply(wave.client[0], Done(seq=wave.client[1]))

    def _on_done(self, link: _Link, seq: int) -> None:
        wave = self._waves.get(seq)
        if wave is None or link.ident not in wave.waiting:
            self.drops["unknown"] += 1
            return
        # The link dropped everything of the attempt before it confirmed: its window is free.
        for tid, (attempt, size) in list(link.inflight.items()):
            if attempt == wave.attempt:
                del link.inflight[tid]
                link.inflight_bytes -= size
        wave.waiting.discard(link.ident)
        self._pump(link)
        if not wave.waiting:
            self._finish(wave)

    # -- membership and liveness ------------------------------------------------------------

    def _on_subscribe(self, ident: bytes, frame: Subscribe | Unsubscribe, now: float) -> None:
        link = self._links.get(ident)
        if isinstance(frame, Unsubscribe):
            if link is None:
                self.drops["unknown"] += 1
            else:
                self._lose(link)
            return
        try:
            name = ident[len(RECEIVER) :].decode()
        except UnicodeDecodeError:
            self.drops["malformed"] += 1
            return
        if frame.window < 1 or frame.window_bytes < 1:
            self.drops["malformed"] += 1
            return
        if link is not None and link.nonce != frame.nonce:
            self._lose(link)
            link = None
        if link is None:
            self._links[ident] = _Link(
                ident=ident,
                nonce=frame.nonce,
                capacity=min(frame.window, self.config.receiver_window),
                capacity_bytes=self.config.receiver_window * self.config.max_payload_bytes,
                receivers=frozenset({name}),
                heard=now,
            )
            self._announce()
        else:
            link.heard = now

    def _on_join(self, ident: bytes, frame: Join, now: float) -> None:
        if frame.capacity < 1 or frame.capacity_bytes < 1:
            self.drops["malformed"] += 1
            return
        link = self._links.get(ident)
        if link is not None and link.nonce != frame.nonce:
            self._lose(link)
            link = None
        if link is None:
            link = self._links[ident] = _Link(
                ident=ident,
                nonce=frame.nonce,
                capacity=frame.capacity,
                capacity_bytes=frame.capacity_bytes,
                receivers=frame.receivers,
                heard=now,
            )
        link.heard = now
        if link.receivers != frame.receivers:
            link.receivers = frame.receivers
        self._announce()

    def _announce(self, *, force: bool = False) -> None:
        """Tell the parent this node's window and subtree receivers (when they changed)."""
        if self._dealer is None:
            return
        receivers = self.receivers()
        if force or receivers != self._announced:
            self._announced = receivers
            self._up(
                Join(
                    nonce=self.nonce,
                    capacity=self.config.max_buffered,
                    capacity_bytes=self.config.max_buffered_bytes,
                    receivers=receivers,
                )
            )

    def _lose(self, link: _Link) -> None:
        """A link vanished: stop waiting for it anywhere."""
        if self._links.get(link.ident) is not link:
            return
        del self._links[link.ident]
        self.peers_lost += 1
        for seq in [*link.inflight, *link.queue]:
            t = self._transfers.get(seq)
            if t is not None and link.ident in t.waiting:
                t.waiting.discard(link.ident)
                if not t.waiting:
                    self._complete(t)
        for wave in list(self._waves.values()):
            if link.ident in wave.waiting:
                wave.waiting.discard(link.ident)
                if not wave.waiting:
                    self._finish(wave)
        self._announce()

    def _tick(self, now: float) -> None:
        timeout = self.config.peer_timeout_s
        ping = Ping(nonce=self.nonce)
        for link in list(self._links.values()):
            if now - link.heard > timeout or not self._emit(link.ident, ping):
                self._lose(link)
        for client in list(self._clients.values()):
            silent = now - client.heard
            busy = client.granted or any(i == client.ident for i, _ in self._offers)
            if silent > (timeout if busy else 10 * timeout):
                self._forget_client(client.ident)
        self._announce(force=True)
        self._admit()


async def _receive(sock: zmq.asyncio.Socket, name: str) -> list[zmq.Frame]:
    try:
        return await sock.recv_multipart(copy=False)
    except zmq.ZMQError as exc:
        raise TransportError(f"relay node {name}: {exc}", retryable=True, check="socket") from exc


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; a port of ``0`` picks a free one.  Returns the bound address."""
    try:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[: -len(":0")]
            port = sock.bind_to_random_port(host)
            return f"{host}:{port}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {address}: {exc}", retryable=True, check="bind") from exc
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


async def start_tree(
    tg: anyio.abc.TaskGroup,
    names: Sequence[str],
    *,
    fanout: int = 2,
    config: RelayConfig | None = None,
    host: str = "127.0.0.1",
    context: zmq.asyncio.Context | None = None,
) -> dict[str, RelayNode]:
    """Start a balanced tree of relay nodes in ``tg`` (parents first); ``names[0]`` is the root."""
    parents = balanced_tree(names, fanout)
    nodes: dict[str, RelayNode] = {}
    for name in names:
        parent = parents[name]
        node = RelayNode(
            name,
            bind=f"tcp://{host}:0",
            parent=None if parent is None else nodes[parent].address,
            config=config,
            context=context,
        )
        await tg.start(node.serve)
        nodes[name] = node
    return nodes
