"""The relay-tree transport's client side (paper §7.1, App. B "Transports", App. C Fig. C.1
``RelayTree``): :class:`RelayTransport`, what owners, the coordinator and receivers use.

Owners stream payloads over ZeroMQ DEALER/ROUTER sockets to one root relay node on the rollout
side, which forwards them over a balanced tree of :class:`RelayNode`\\ s; each node hands them
to the receivers it hosts, and queueing ACKs flow back up.  :class:`RelayTransport` is what one
process uses: ``root`` is the root's address (owners send there, the coordinator stops and
cleans up attempts there), ``node`` the address of the relay node hosting this process's
receivers.  With the fleet's keys (``security``) every connection is CURVE: the root client
speaks as ``identity`` (``owner:<name>`` or ``coordinator:main``), a subscription as
``receiver:<name>``, and each checks the key of the node it reaches, so it needs the node's
name (``root_name``, ``node_name``) besides its address.  ``send`` returns once every
addressed, subscribed receiver has *taken* the payload (:meth:`RelayTransport.taken`, the
queueing ACK), so each node's buffer and each receiver's window stay bounded and a slow
receiver slows the owners instead of growing memory.

The transport runs its socket readers as tasks of the running asyncio loop (pyzmq's asyncio
sockets do not run on trio); :meth:`RelayTransport.aclose` stops them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.context import dataclass_options, known_options
from dcr.adapters.security import Identity, Security
from dcr.adapters.transport.base import Deliveries, Delivery, Transport, TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay.config import Held, RelayConfig
from dcr.adapters.transport.relay.frames import Offer, Query, Stop, Unsubscribe
from dcr.adapters.transport.relay.rootclient import Request, RootClient
from dcr.adapters.transport.relay.subscription import Subscription
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.wire.format import DecodeLimits

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["RelayTransport", "TreeStatus", "open_relay_transport"]


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


class RelayTransport(Transport):
    """A process's connection to the relay tree (owners, coordinator, receivers).

    ``root`` is needed to send, stop and clean up; ``node`` to subscribe receivers.
    Connections open on first use.  With keys, ``identity`` is who the root client speaks as,
    and ``root_name`` / ``node_name`` name the relay nodes at ``root`` / ``node``.
    ``stats()`` counts what this object sent (every copy in ``cross_bytes``, each key once in
    ``payload_bytes``); the root's own counters are in :meth:`tree_status`.
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
        security: Security | None = None,
        identity: Identity | None = None,
        root_name: str | None = None,
        node_name: str | None = None,
    ) -> None:
        self.root = root
        self.node = node
        self.config = config or RelayConfig()
        self.security = security or Security()
        self.identity = identity
        self.root_name = root_name
        self.node_name = node_name
        self.receiver_window = self.config.receiver_window
        self._context = context
        self._own_context = context is None
        self._client: RootClient | None = None
        self._subs: dict[str, Subscription] = {}
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
        raises :class:`~dcr.errors.ConfigError` in a fleet that was not started.  The keys and
        this process's identity are the context's (``security``, ``identity``).

        ``max_payload_bytes``, unless set, is what receivers decode at most here
        (:class:`~dcr.wire.format.DecodeLimits`): the relay nodes enforce the fleet's own bound
        (from its catalog and bucket size, :func:`dcr.fleet.relay.relay_config`), so a larger
        one on this side only lets a node refuse what it will not carry (``oversized``) and
        never refuses what a node delivers."""
        known = {"fanout", *(f.name for f in fields(RelayConfig))}
        opts = known_options(options, known, context.section)
        fanout = opts.pop("fanout", 2)
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
            raise ConfigError(f"[{context.section}]: fanout must be an integer >= 1, "
                              f"got {fanout!r}")  # fmt: skip
        opts.setdefault("max_payload_bytes", DecodeLimits().max_payload_bytes)
        config = dataclass_options(RelayConfig, opts, context.section)
        root = context.node_address(context.root)
        node = context.node_address(context.node) if context.node is not None else None
        return cls(
            root=root,
            node=node,
            config=config,
            security=context.security,
            identity=context.identity,
            root_name=context.root,
            node_name=context.node,
        )

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

    def _root_client(self) -> RootClient:
        if self.root is None:
            raise TransportError(
                "this relay transport has no root address", retryable=False, check="config"
            )
        ctx = self._ctx()
        if self._client is None or self._client.broken is not None:
            try:
                self._client = RootClient(
                    self.root, ctx, self.config, self._count_sent, self.uplink,
                    security=self.security, identity=self.identity, server=self.root_name,
                )  # fmt: skip
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
        req = Request(attempt=key.attempt, key=key, data=data)
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
            Request(attempt=attempt),
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
            sub = Subscription(
                receiver, self.node, ctx, self.config,
                security=self.security, server=self.node_name,
            )  # fmt: skip
        except zmq.ZMQError as exc:
            raise TransportError(
                f"cannot connect to the relay node {self.node}: {exc}",
                retryable=False,
                check="config",
            ) from exc
        self._subs[receiver] = sub
        sub.task = self._spawn(sub.run(), sub.sock)
        return Deliveries(sub)

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
        req = await self._root_client().call(lambda seq: Query(seq=seq), Request(attempt=None))
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
    security: Security | None = None,
    identity: Identity | None = None,
    root_name: str | None = None,
    node_name: str | None = None,
) -> AsyncIterator[RelayTransport]:
    """A :class:`RelayTransport` closed when the block ends."""
    transport = RelayTransport(
        root=root, node=node, config=config, security=security, identity=identity,
        root_name=root_name, node_name=node_name,
    )  # fmt: skip
    try:
        yield transport
    finally:
        await transport.aclose()
