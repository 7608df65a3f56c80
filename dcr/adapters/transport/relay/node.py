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

:class:`RelayNode` serves the sockets, dispatches frames and keeps the links alive; it builds on
the node's state (``state``), delivery down the tree (``forwarding``) and, at the root, the
admission of owners' payloads (``grants``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from dcr.adapters.transport.relay.config import RelayConfig, balanced_tree
from dcr.adapters.transport.relay.frames import (
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
)
from dcr.adapters.transport.relay.grants import Grants
from dcr.adapters.transport.relay.sockets import (
    CLIENT,
    NODE,
    RECEIVER,
    bind,
    decode_frames,
    receive,
    set_common_options,
)
from dcr.adapters.transport.relay.state import Link
from dcr.errors import TransportError

__all__ = ["RelayNode", "start_tree"]


class RelayNode(Grants):
    """One relay node: a ROUTER that children, receivers and (at the root) owners connect to,
    plus a DEALER to its parent unless it is the root.

    ``bind`` ending in ``:0`` picks a free port; :attr:`address` is the bound address once
    :meth:`serve` started.  ``drops`` counts frames dropped per reason (``truncated``,
    ``magic``, ``version``, ``kind``, ``malformed``, ``parts``, ``oversized``, ``replayed``,
    ``unknown``, ``role``, ``direction``, ``stopped``, ``overflow``, ``unsent``); a bad frame
    changes nothing else; ``peers_lost`` counts links dropped as vanished.  Serve each node
    object once.
    """

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
            self._address = bind(router, self.bind)
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
            self._on_router(await receive(sock, self.name))

    async def _read_parent(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._on_parent(await receive(sock, self.name))

    async def _tick_forever(self) -> None:
        while True:
            await anyio.sleep(self.config.ping_interval_s)
            self._tick(time.monotonic())

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
            self._links[ident] = Link(
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
            link = self._links[ident] = Link(
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

    def _lose(self, link: Link) -> None:
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
