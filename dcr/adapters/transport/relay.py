"""The relay-tree transport (paper §7.1, App. B "Transports", App. C Fig. C.1 ``RelayTree``).

Owners stream payloads over ZeroMQ DEALER/ROUTER sockets to one root relay node on the rollout
side, which forwards them over a balanced tree of :class:`RelayNode`\\ s; each node hands them
to the receivers it hosts, and queueing ACKs flow back up.  :class:`RelayTransport` is what one
process uses: ``root`` is the root's address (owners send there, the coordinator stops and
cleans up attempts there), ``node`` the address of the relay node hosting this process's
receivers.  ``send`` returns once every addressed, subscribed receiver has *taken* the payload
(:meth:`RelayTransport.taken`, the queueing ACK), so each node's buffer and each receiver's
window stay bounded and a slow receiver slows the owners instead of growing memory.

The transport runs its socket readers as tasks of the running asyncio loop (pyzmq's asyncio
sockets do not run on trio); :meth:`RelayTransport.aclose` stops them.  Run
``python -m dcr.adapters.transport.relay node|receiver ...`` to host a relay node or a
stand-alone receiver in a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import secrets
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self, cast

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.context import dataclass_options, known_options
from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.adapters.transport.link import CHUNK as LINK_CHUNK
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay_node import (
    CLIENT,
    RECEIVER,
    Held,
    RelayConfig,
    RelayNode,
    balanced_tree,
    decode_frames,
    routing_id,
    send_now,
    set_common_options,
    start_tree,
)
from dcr.adapters.transport.relay_wire import (
    Ack,
    Answer,
    Cancel,
    Data,
    Delivered,
    Done,
    Frame,
    FrameError,
    Grant,
    Offer,
    Payload,
    Ping,
    Pong,
    Query,
    Refused,
    Stop,
    Subscribe,
    Unsubscribe,
    encode,
)
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = [
    "Held",
    "RelayConfig",
    "RelayNode",
    "RelayTransport",
    "TreeStatus",
    "balanced_tree",
    "main",
    "open_relay_transport",
    "start_tree",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeStatus:
    """What the root reports: the receivers subscribed anywhere in the tree, and the traffic
    that crossed into it (V_cross, V_payload)."""

    receivers: frozenset[str]
    stats: TransportStats


def _stopped_error(attempt: int) -> TransportError:
    return TransportError(
        "the attempt was stopped; payload refused",
        retryable=False,
        attempt=attempt,
        check="stopped",
    )


def _connect(sock: zmq.asyncio.Socket, address: str) -> None:
    """Connect, closing the socket if the address is refused."""
    try:
        sock.connect(address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise


@dataclass(slots=True, eq=False)
class _Request:
    """One call to the root waiting for its answer."""

    attempt: int | None
    key: PayloadKey | None = None
    data: bytes | None = None
    granted: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: TransportError | None = None
    answer: Answer | None = None
    paced: bool = False
    """Granted, its data waits for the sender's emulated link before it leaves."""
    sent: bool = False

    def fail(self, error: TransportError) -> None:
        if self.error is None and not self.done.is_set():
            self.error = error
        self.granted.set()
        self.done.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _RootClient:
    """A DEALER to the root: offers, data, stop and cleanup requests, queries.

    Every frame leaves through one writer in the order it was queued, so a process's sends
    reach the root in the order ``send`` was called.  The client pings the root every
    ``ping_interval_s``, also while idle, and learns the root's incarnation (its nonce) before
    its first request leaves, so a root that restarted is always noticed: silence for
    ``peer_timeout_s`` while a request waits, or a changed root incarnation, fails every
    waiting request as retryable (the attempt fails and is retried, paper App. B.2) instead of
    leaving it waiting for an answer that died with the old root.
    """

    def __init__(
        self,
        address: str,
        ctx: zmq.asyncio.Context,
        config: RelayConfig,
        on_data: Callable[[PayloadKey, int], None],
        uplink: LinkLimit | None = None,
    ) -> None:
        self.address = address
        self.config = config
        self.on_data = on_data
        self.uplink = uplink if uplink is not None and uplink.bytes_per_s is not None else None
        self.sock = ctx.socket(zmq.DEALER)
        set_common_options(self.sock, config)
        self.sock.setsockopt(zmq.ROUTING_ID, CLIENT + secrets.token_hex(8).encode())
        _connect(self.sock, address)
        self.pending: dict[int, _Request] = {}
        self.seq = itertools.count(1)
        self.outbox, self._outbox_recv = anyio.create_memory_object_stream[list[Any]](math.inf)
        self.heard = time.monotonic()
        self.root_nonce: int | None = None
        self.hello = anyio.Event()
        """Set once the root's incarnation is known (its first ``PONG``)."""
        self.broken: TransportError | None = None
        self.drops: Counter[str] = Counter()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read)
                tg.start_soon(self._write)
                tg.start_soon(self._keepalive)
        except* zmq.ZMQError as group:
            self.broken = TransportError(
                f"relay connection to {self.address} failed: {group.exceptions[0]}",
                retryable=True,
                check="socket",
            )
        finally:
            self.close()

    def close(self) -> None:
        """Fail whatever still waits (also when the reader task never ran)."""
        self.broken = self.broken or TransportError(
            "the relay transport was closed", retryable=False, check="closed"
        )
        self._fail_all(self.broken)
        self.outbox.close()
        self._outbox_recv.close()

    def _fail_all(self, error: TransportError) -> None:
        pending, self.pending = self.pending, {}
        for req in pending.values():
            req.fail(error)

    def _queue(self, parts: list[Any]) -> None:
        try:
            self.outbox.send_nowait(parts)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.drops["unsent"] += 1

    async def call(self, make: Callable[[int], Frame], req: _Request) -> _Request:
        """Queue the frame ``make(seq)`` and wait for the root's answer (and grant)."""
        if self.broken is not None:
            raise self.broken
        if not self.hello.is_set():
            await self._handshake(req)
        seq = next(self.seq)
        try:
            header = encode(make(seq))
        except FrameError as exc:
            raise TransportError(
                f"cannot encode a relay frame: {exc}",
                retryable=False,
                attempt=req.attempt,
                check="encode",
            ) from exc
        if not self.pending:
            self.heard = time.monotonic()
        self.pending[seq] = req
        try:
            self._queue([header])
            await req.granted.wait()
            req.check()
            if req.paced and self.uplink is not None:
                assert req.data is not None
                left = len(req.data)
                while left > 0 and req.error is None:  # a refusal ends the wait early
                    await self.uplink.take(min(left, LINK_CHUNK))
                    left -= LINK_CHUNK
                req.check()
                self._send_data(seq, req)
            await req.done.wait()
            req.check()
            return req
        finally:
            self.pending.pop(seq, None)
            if req.data is not None and not req.sent and req.error is None:
                self._queue([encode(Cancel(seq=seq))])  # the caller gave up before its data

    def _send_data(self, seq: int, req: _Request) -> None:
        assert req.data is not None and req.key is not None
        self._queue([encode(Data(seq=seq, size=len(req.data))), req.data])
        req.sent = True
        self.on_data(req.key, len(req.data))

    async def _handshake(self, req: _Request) -> None:
        """Wait for the root's incarnation (the keepalive pings until it answers)."""
        self._queue([encode(Ping(nonce=0))])
        with anyio.move_on_after(self.config.peer_timeout_s):
            await self.hello.wait()
        if self.broken is not None:
            raise self.broken
        if not self.hello.is_set():
            raise self._silent(req.attempt)

    def _silent(self, attempt: int | None = None) -> TransportError:
        return TransportError(
            f"the relay root {self.address} did not answer for {self.config.peer_timeout_s} s",
            retryable=True,
            attempt=attempt,
            check="peer-lost",
        )

    async def _write(self) -> None:
        async for parts in self._outbox_recv:
            await self.sock.send_multipart(parts, copy=False)

    async def _keepalive(self) -> None:
        ping = encode(Ping(nonce=0))
        while True:
            await anyio.sleep(self.config.ping_interval_s)
            self._queue([ping])  # also while idle: a restarted root is noticed before a call
            if self.pending and time.monotonic() - self.heard > self.config.peer_timeout_s:
                self._fail_all(self._silent())

    async def _read(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            self.heard = time.monotonic()
            try:
                frame, _ = decode_frames(parts, max_size=0)
            except FrameError as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, Pong):
            if self.root_nonce is not None and frame.nonce != self.root_nonce:
                self._fail_all(
                    TransportError(
                        f"the relay root {self.address} restarted",
                        retryable=True,
                        check="root-restarted",
                    )
                )
            self.root_nonce = frame.nonce
            self.hello.set()
            return
        if not isinstance(frame, Grant | Delivered | Done | Answer | Refused):
            self.drops["direction"] += 1
            return
        req = self.pending.get(frame.seq)
        if isinstance(frame, Grant):
            if req is None or req.data is None or req.key is None:
                self._queue([encode(Cancel(seq=frame.seq))])
                return
            if self.uplink is None:
                self._send_data(frame.seq, req)
            else:
                req.paced = True  # call() sends it once the link carried it
            req.granted.set()
        elif req is None:
            self.drops["unknown"] += 1
        elif isinstance(frame, Refused):
            req.fail(
                TransportError(
                    frame.reason, retryable=frame.retryable, attempt=req.attempt, check=frame.check
                )
            )
        else:
            if isinstance(frame, Answer):
                req.answer = frame
            req.granted.set()
            req.done.set()


class _Subscription:
    """One receiver's DEALER to its relay node (routing id = the receiver's name).

    It repeats ``SUBSCRIBE`` every ``ping_interval_s`` as its heartbeat, so after its node
    restarts at the same address (ZeroMQ reconnects by itself) the receiver is subscribed
    again within one interval.  Deliveries wait in an inbox until read; the node never sends
    more than the advertised window of deliveries that were not taken yet.
    """

    def __init__(
        self, receiver: str, address: str, ctx: zmq.asyncio.Context, config: RelayConfig
    ) -> None:
        self.receiver = receiver
        self.config = config
        ident = routing_id(RECEIVER, receiver)
        self.sock = ctx.socket(zmq.DEALER)
        set_common_options(self.sock, config)
        self.sock.setsockopt(zmq.ROUTING_ID, ident)
        _connect(self.sock, address)
        self.nonce = secrets.randbits(63) | 1
        self.inbox: deque[Delivery] = deque()
        self.untaken: dict[PayloadKey, deque[tuple[int, int]]] = {}
        self.count = self.bytes = self.peak_count = self.peak_bytes = self.largest = 0
        self.closed = False
        self.wake: anyio.Event | None = None
        self.last_payload = (0, 0)
        self.last_wave = (0, 0)
        self.drops: Counter[str] = Counter()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._beat)
                tg.start_soon(self._read)
        except* (zmq.ZMQError, TransportError):
            self.drops["socket"] += 1
        finally:
            self.close()

    def close(self) -> None:
        """End the deliveries: nothing more is yielded, even what already arrived."""
        self.closed = True
        self.inbox.clear()
        self._wake()

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def emit(self, frame: Frame) -> None:
        if self.sock.closed or not send_now(self.sock, [encode(frame)]):
            self.drops["unsent"] += 1

    async def _beat(self) -> None:
        frame = Subscribe(
            nonce=self.nonce,
            window=self.config.receiver_window,
            window_bytes=self.config.receiver_window * self.config.max_payload_bytes,
        )
        while True:
            self.emit(frame)
            await anyio.sleep(self.config.ping_interval_s)

    async def _read(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                frame, body = decode_frames(parts, max_size=self.config.max_payload_bytes)
            except FrameError as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            if isinstance(frame, Payload):
                assert body is not None
                self._on_payload(frame, cast(zmq.Frame, body).bytes)
            elif isinstance(frame, Stop):
                self._on_stop(frame)
            elif not isinstance(frame, Ping):
                self.drops["direction"] += 1

    def _on_payload(self, frame: Payload, data: bytes) -> None:
        if frame.origin == self.last_payload[0] and frame.seq <= self.last_payload[1]:
            self.drops["replayed"] += 1
            return
        self.last_payload = (frame.origin, frame.seq)
        self.inbox.append(Delivery(key=frame.key, data=data))
        self.untaken.setdefault(frame.key, deque()).append((frame.seq, frame.size))
        self.count += 1
        self.bytes += frame.size
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.largest = max(self.largest, frame.size)
        self._wake()

    def _on_stop(self, frame: Stop) -> None:
        """Drop what this receiver holds of the attempt, then confirm to the node."""
        if frame.origin == self.last_wave[0] and frame.seq <= self.last_wave[1]:
            self.drops["replayed"] += 1
            return
        self.last_wave = (frame.origin, frame.seq)
        self.inbox = deque(d for d in self.inbox if d.key.attempt != frame.attempt)
        for key in [k for k in self.untaken if k.attempt == frame.attempt]:
            for _, size in self.untaken.pop(key):
                self.count -= 1
                self.bytes -= size
        self.emit(Done(seq=frame.seq))

    def take(self, key: PayloadKey) -> None:
        entries = self.untaken.get(key)
        if not entries:
            self.drops["unknown"] += 1
            return
        seq, size = entries.popleft()
        if not entries:
            del self.untaken[key]
        self.count -= 1
        self.bytes -= size
        self.emit(Ack(seq=seq))

    def held(self) -> Held:
        return Held(
            count=self.count,
            bytes=self.bytes,
            peak_count=self.peak_count,
            peak_bytes=self.peak_bytes,
            max_count=self.config.receiver_window,
            max_bytes=self.config.receiver_window * max(self.largest, 1),
        )


class _Deliveries:
    """The async iterator ``subscribe`` returns; it ends once the subscription ends."""

    def __init__(self, sub: _Subscription) -> None:
        self._sub = sub

    def __aiter__(self) -> _Deliveries:
        return self

    async def __anext__(self) -> Delivery:
        sub = self._sub
        while not sub.inbox:
            if sub.closed:
                raise StopAsyncIteration
            sub.wake = anyio.Event()
            await sub.wake.wait()
        return sub.inbox.popleft()


class RelayTransport(Transport):
    """A process's connection to the relay tree (owners, coordinator, receivers).

    ``root`` is needed to send, stop and clean up; ``node`` to subscribe receivers.
    Connections open on first use.  ``stats()`` counts what this object sent (every copy in
    ``cross_bytes``, each key once in ``payload_bytes``); the root's own counters are in
    :meth:`tree_status`.
    """

    arrival_grace_s = 1.0
    """``send`` returns only after every subscribed receiver took the payload, so whatever
    has not arrived once the owners' sends returned will not arrive; the grace covers only
    scheduling between an owner's last send and the receiver's arrival check."""
    needs_relay_processes: ClassVar[bool] = True
    """A fleet runs one ``dcr relay`` process per rollout node (the tree)."""

    def __init__(
        self,
        *,
        root: str | None = None,
        node: str | None = None,
        config: RelayConfig | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.root = root
        self.node = node
        self.config = config or RelayConfig()
        self.receiver_window = self.config.receiver_window
        self._context = context
        self._own_context = context is None
        self._client: _RootClient | None = None
        self._subs: dict[str, _Subscription] = {}
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped: set[int] = set()
        self._seen: set[PayloadKey] = set()
        self._stats = TransportStats()
        self._closed = False
        self.uplink = LinkLimit(self.config.link_gbps)
        """This process's side of the cross-cluster link: payload bytes it sends to the root
        pass it first (``config.link_gbps``; unlimited by default)."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """A process's connection to the fleet's relay tree: ``root`` at the first rollout
        node, ``node`` at the process's own node (where its receivers subscribe).  The keys
        are :class:`RelayConfig` fields, plus ``fanout``: the shape of the tree, which the
        relay processes read.  The addresses come from the ports the launcher chose, so this
        raises :class:`~dcr.errors.ConfigError` in a fleet that was not started."""
        known = {"fanout", *(f.name for f in fields(RelayConfig))}
        opts = known_options(options, known, context.section)
        fanout = opts.pop("fanout", 2)
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
            raise ConfigError(f"[{context.section}]: fanout must be an integer >= 1, "
                              f"got {fanout!r}")  # fmt: skip
        config = dataclass_options(RelayConfig, opts, context.section)
        root = context.node_address(context.root)
        node = context.node_address(context.node) if context.node is not None else None
        return cls(root=root, node=node, config=config)

    # -- plumbing ---------------------------------------------------------------------------

    def _ctx(self) -> zmq.asyncio.Context:
        if self._closed:
            raise TransportError("the relay transport is closed", retryable=False, check="closed")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        return self._context

    def _spawn(
        self, coro: Coroutine[Any, Any, None], sock: zmq.asyncio.Socket
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        self._sockets.append(sock)

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if sock in self._sockets:
                self._sockets.remove(sock)
            sock.close(linger=100)  # lets a last UNSUBSCRIBE leave
            if not t.cancelled():
                t.exception()

        task.add_done_callback(done)
        return task

    def _root_client(self) -> _RootClient:
        if self.root is None:
            raise TransportError(
                "this relay transport has no root address", retryable=False, check="config"
            )
        ctx = self._ctx()
        if self._client is None or self._client.broken is not None:
            try:
                self._client = _RootClient(
                    self.root, ctx, self.config, self._count_sent, self.uplink
                )
            except zmq.ZMQError as exc:
                raise TransportError(
                    f"cannot connect to the relay root {self.root}: {exc}",
                    retryable=False,
                    check="config",
                ) from exc
            self._spawn(self._client.run(), self._client.sock)
        return self._client

    def _count_sent(self, key: PayloadKey, size: int) -> None:
        s = self._stats
        new = key not in self._seen
        self._seen.add(key)
        self._stats = TransportStats(
            payloads=s.payloads + new,
            payload_bytes=s.payload_bytes + (size if new else 0),
            cross_bytes=s.cross_bytes + size,
        )

    # -- Transport --------------------------------------------------------------------------

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        if key.attempt in self._stopped:
            raise _stopped_error(key.attempt)
        if len(data) > self.config.max_payload_bytes:
            raise TransportError(
                f"payload of {len(data)} bytes above the relay limit "
                f"{self.config.max_payload_bytes}",
                retryable=False,
                attempt=key.attempt,
                check="oversized",
            )
        client = self._root_client()
        req = _Request(attempt=key.attempt, key=key, data=data)
        await client.call(lambda seq: Offer(seq=seq, key=key, size=len(data), to=to), req)

    async def stop_and_wait(self, attempt: int) -> None:
        """Stop the attempt everywhere in the tree; returns once every live node and receiver
        dropped what it held of it (paper App. C, ``stop_forwarding`` + ``collect_acks``)."""
        self._stopped.add(attempt)
        await self._wave(attempt, cleanup=False)

    async def cleanup(self, attempt: int) -> None:
        """Stop the attempt and release its per-attempt state (V_payload keys, ACK tracking)."""
        self._stopped.add(attempt)
        self._seen = {k for k in self._seen if k.attempt != attempt}
        await self._wave(attempt, cleanup=True)

    async def _wave(self, attempt: int, *, cleanup: bool) -> None:
        client = self._root_client()
        await client.call(
            lambda seq: Stop(origin=0, seq=seq, attempt=attempt, cleanup=cleanup),
            _Request(attempt=attempt),
        )

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        if self.node is None:
            raise TransportError(
                "this relay transport has no node address", retryable=False, check="config"
            )
        ctx = self._ctx()
        if receiver in self._subs:
            raise TransportError(
                f"{receiver!r} is already subscribed", retryable=False, check="subscribe"
            )
        try:
            sub = _Subscription(receiver, self.node, ctx, self.config)
        except zmq.ZMQError as exc:
            raise TransportError(
                f"cannot connect to the relay node {self.node}: {exc}",
                retryable=False,
                check="config",
            ) from exc
        self._subs[receiver] = sub
        sub.task = self._spawn(sub.run(), sub.sock)
        return _Deliveries(sub)

    def unsubscribe(self, receiver: str) -> None:
        sub = self._subs.pop(receiver, None)
        if sub is None:
            return
        sub.emit(Unsubscribe())
        sub.close()
        if sub.task is not None:
            sub.task.cancel()

    async def taken(self, receiver: str, key: PayloadKey) -> None:
        sub = self._subs.get(receiver)
        if sub is not None:
            sub.take(key)

    def stats(self) -> TransportStats:
        return self._stats

    async def aclose(self) -> None:
        """Close every connection at once (without unsubscribing: nodes notice within a ping
        interval, as when the process dies)."""
        self._closed = True
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            self._client.close()
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    # -- relay extras -----------------------------------------------------------------------

    async def tree_status(self) -> TreeStatus:
        """Ask the root which receivers are subscribed and what crossed into the tree."""
        req = await self._root_client().call(lambda seq: Query(seq=seq), _Request(attempt=None))
        a = req.answer
        assert a is not None
        return TreeStatus(
            receivers=a.receivers,
            stats=TransportStats(
                payloads=a.payloads, payload_bytes=a.payload_bytes, cross_bytes=a.cross_bytes
            ),
        )

    def drops(self) -> Counter[str]:
        """Frames this process dropped, per reason (as :attr:`RelayNode.drops`)."""
        out: Counter[str] = Counter()
        if self._client is not None:
            out += self._client.drops
        for sub in self._subs.values():
            out += sub.drops
        return out

    def held(self, receiver: str) -> Held:
        """Deliveries ``receiver`` holds and has not taken yet (bounded by its window)."""
        sub = self._subs.get(receiver)
        if sub is None:
            raise TransportError(f"{receiver!r} is not subscribed", retryable=False)
        return sub.held()


@asynccontextmanager
async def open_relay_transport(
    *,
    root: str | None = None,
    node: str | None = None,
    config: RelayConfig | None = None,
) -> AsyncIterator[RelayTransport]:
    """A :class:`RelayTransport` closed when the block ends."""
    transport = RelayTransport(root=root, node=node, config=config)
    try:
        yield transport
    finally:
        await transport.aclose()


# -- processes of their own ---------------------------------------------------------------------


async def _run_node(args: argparse.Namespace, config: RelayConfig) -> None:
    node = RelayNode(args.name, bind=args.bind, parent=args.parent, config=config)
    with anyio.move_on_after(args.lifetime):
        async with anyio.create_task_group() as tg:
            await tg.start(node.serve)
            print(f"READY {node.address}", flush=True)


async def _run_receiver(args: argparse.Namespace, config: RelayConfig) -> None:
    async with open_relay_transport(node=args.node, config=config) as transport:
        with anyio.move_on_after(args.lifetime):
            print("READY", flush=True)
            async for d in transport.subscribe(args.name):
                if args.delay:
                    await anyio.sleep(args.delay)
                await transport.taken(args.name, d.key)
                print(f"GOT {d.key.attempt} {d.key.owner} {d.key.payload_id}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dcr.adapters.transport.relay node|receiver ...``: one relay node, or one
    receiver that takes every delivery, in a process of its own (bounded by ``--lifetime``)."""
    parser = argparse.ArgumentParser(prog="python -m dcr.adapters.transport.relay")
    parser.add_argument("--lifetime", type=float, default=3600.0, help="exit after this many s")
    parser.add_argument("--ping", type=float, default=0.25, help="ping interval, s")
    parser.add_argument("--timeout", type=float, default=3.0, help="peer timeout, s")
    sub = parser.add_subparsers(dest="role", required=True)
    node = sub.add_parser("node", help="serve one relay node")
    node.add_argument("--name", required=True)
    node.add_argument("--bind", default="tcp://127.0.0.1:0")
    node.add_argument("--parent", default=None, help="parent address; omit for the root")
    rx = sub.add_parser("receiver", help="subscribe one receiver that takes every delivery")
    rx.add_argument("--name", required=True)
    rx.add_argument("--node", required=True, help="address of the hosting relay node")
    rx.add_argument("--delay", type=float, default=0.0, help="seconds before taking each one")
    args = parser.parse_args(argv)
    config = RelayConfig(ping_interval_s=args.ping, peer_timeout_s=args.timeout)
    run = _run_node if args.role == "node" else _run_receiver
    anyio.run(run, args, config, backend="asyncio")


if __name__ == "__main__":
    main(sys.argv[1:])
