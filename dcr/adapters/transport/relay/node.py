"""Relay nodes of the relay-tree transport (paper §7.1, App. B "Transports").

Owners stream payloads to one *root* node on the rollout side; the root forwards them over a
balanced tree of relay nodes, each node hands them to the receivers it hosts, and queueing ACKs
flow back up.  A node's links downwards (child nodes and its receivers) each get at most a
window of unacknowledged transfers; a child advertises its window (its own buffer bound) when
it joins, a receiver when it subscribes.  A transfer leaves a node's buffer only once every link
it went to acknowledged it, so a slow receiver fills its node's buffer, then its parent's, and
finally the root stops granting owners room: owners slow down and no buffer grows past its bound.

Who speaks: with the fleet's keys (``security``) a node's ROUTER is the CURVE server
``relay:<node>`` and admits only keyring members; each connection's role and name come from its
key (owner and coordinator keys are clients, relay keys child nodes, receiver keys receivers
that subscribe under their key's name), never from a routing id.  Connections are keyed by the
routing id ZeroMQ assigns them, ``ROUTER_HANDOVER`` is off, and a new connection of a child or
receiver replaces the older link *of the same name* only.  A frame a role may not send is
dropped and counted (``role``).  Without keys (a loopback fleet) roles come from routing-id
prefixes and a restarted peer takes its routing id over (``ROUTER_HANDOVER``); binding an
address off this host then needs ``insecure`` (:func:`~dcr.adapters.security.check_bind`).

Liveness without libzmq's draft API: ROUTER sockets use ``ROUTER_MANDATORY`` (sending to a
vanished peer fails at once with ``EHOSTUNREACH``); every node pings its links each
``ping_interval_s``, and children and receivers repeat their ``JOIN`` / ``SUBSCRIBE`` as
heartbeats, so a link silent for ``peer_timeout_s`` is dropped too.  Dropping a link drops
everything waited for on it.  Every peer is held to its bounds (``guard``).

A node's state changes only in synchronous handlers that run between awaits; sends never block
(``NOBLOCK``), so handlers never interleave.

:class:`RelayNode` serves the sockets, dispatches frames and keeps the links alive; it builds on
the node's state (``state``), delivery down the tree (``forwarding``), at the root the admission
of owners' payloads (``grants``), and the per-peer bounds (``guard``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import anyio.abc
import zmq
import zmq.asyncio

from dcr.adapters.security import RELAY, Security, check_bind
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
from dcr.adapters.transport.relay.guard import Guard
from dcr.adapters.transport.relay.sockets import (
    CLIENT,
    NODE,
    RECEIVER,
    Peer,
    bind,
    decode_frames,
    identify,
    peer_of,
    receive,
    set_common_options,
)
from dcr.adapters.transport.relay.state import Budget, Link
from dcr.errors import TransportError

__all__ = ["RelayNode", "start_tree"]


class RelayNode(Guard):
    """One relay node: a ROUTER that children, receivers and (at the root) owners connect to,
    plus a DEALER to its parent (at ``parent``, named ``parent_name``) unless it is the root.

    ``bind`` ending in ``:0`` picks a free port; :attr:`address` is the bound address once
    :meth:`serve` started.  ``security`` holds the fleet's keys (none: loopback only, unless
    insecure).  ``drops`` counts frames dropped per reason (``truncated``, ``magic``,
    ``version``, ``kind``, ``malformed``, ``parts``, ``oversized``, ``replayed``,
    ``unknown``, ``role``, ``direction``, ``stopped``, ``overflow``, ``unsent``, ``cooloff``
    (from a refused peer), ``peers`` (over ``max_peers``)); a bad frame changes nothing
    else; ``peers_lost`` counts links dropped as vanished, ``peers_refused`` peers refused
    for going over a bound, ``grants_expired`` grants reclaimed; :meth:`auth` the ZAP
    decisions.  Serve each node object once.
    """

    # -- service ----------------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind, join the parent, and relay until cancelled."""
        security: Security = self.security
        check_bind(self.bind, security, f"relay node {self.name}")
        own = self._context is None
        ctx = self._context or zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        dealer: zmq.asyncio.Socket | None = None
        served = False
        try:
            set_common_options(router, self.config)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if not security.keyed:
                # loopback fleets: a restarted peer takes its routing id (its name) over
                router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if self.identity is not None:
                security.server(router, self.identity, RELAY)
                served = True
            self._zmq = ctx
            self._address = bind(router, self.bind)
            self._router = router
            if self.parent is not None:
                dealer = ctx.socket(zmq.DEALER)
                set_common_options(dealer, self.config)
                identify(dealer, security, self.identity, NODE, self.name, self.parent_name)
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
            if served:
                security.release(router)
            if dealer is not None:
                dealer.close(linger=0)
            self._zmq = None
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
        now = time.monotonic()
        if len(parts) < 2:
            self.drops["parts"] += 1
            return
        ident = parts[0].bytes
        peer = peer_of(ident, parts[1], self.security.keyed)
        if self._cooling(peer.key, now):
            self.drops["cooloff"] += 1
            return
        budget = self._budget(peer.key, now)
        if budget is None:
            self.drops["peers"] += 1
            return
        self._window(budget, now)
        before = self._peer_drops()
        self._dispatch(ident, peer, budget, parts, now)
        budget.drops += self._peer_drops() - before
        self._check(budget, now)
        self._admit()

    def _dispatch(
        self, ident: bytes, peer: Peer, budget: Budget, parts: Sequence[zmq.Frame], now: float
    ) -> None:
        got = self._decode(parts[1:])
        if got is None:
            return
        frame, body = got
        role = peer.role
        if role == CLIENT and isinstance(frame, Offer | Data | Cancel | Stop | Query | Ping):
            client = self._client(ident, budget, now)
            if client is None:
                self.drops["peers"] += 1
            else:
                self._on_client(client, frame, body, len(parts[1]), now)
        elif role in (NODE, RECEIVER) and isinstance(frame, Ack | Done):
            link = self._links.get(ident)
            if link is None or link.role != role:
                self.drops["unknown"] += 1
            elif isinstance(frame, Ack):
                link.heard = now
                self._on_ack(link, frame.seq)
            else:
                link.heard = now
                self._on_done(link, frame.seq)
        elif role == RECEIVER and isinstance(frame, Subscribe | Unsubscribe):
            self._on_subscribe(ident, peer, budget, frame, now)
        elif role == NODE and isinstance(frame, Join):
            self._on_join(ident, peer, budget, frame, now)
        elif isinstance(frame, Grant | Delivered | Refused | Payload | Pong | Answer):
            self.drops["direction"] += 1
        else:
            self.drops["role"] += 1

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

    def _on_subscribe(
        self,
        ident: bytes,
        peer: Peer,
        budget: Budget,
        frame: Subscribe | Unsubscribe,
        now: float,
    ) -> None:
        link = self._links.get(ident)
        if isinstance(frame, Unsubscribe):
            if link is None or link.role != RECEIVER:
                self.drops["unknown"] += 1
            else:
                self._lose(link)
            return
        if peer.name is None:
            self.drops["malformed"] += 1
            return
        if frame.receiver != peer.name:
            self.drops["role"] += 1  # a receiver subscribes under its own name only
            return
        if frame.window < 1 or frame.window_bytes < 1:
            self.drops["malformed"] += 1
            return
        if link is not None and link.nonce != frame.nonce:
            self._lose(link)
            link = None
        if link is None:
            link = self._new_link(ident, RECEIVER, peer.name, budget)
            if link is None:
                return
            link.nonce = frame.nonce
            link.capacity = min(frame.window, self.config.receiver_window)
            link.capacity_bytes = self.config.receiver_window * self.config.max_payload_bytes
            link.receivers = frozenset({peer.name})
            link.heard = now
            self._announce()
        else:
            link.heard = now

    def _on_join(self, ident: bytes, peer: Peer, budget: Budget, frame: Join, now: float) -> None:
        if frame.capacity < 1 or frame.capacity_bytes < 1 or peer.name is None:
            self.drops["malformed"] += 1
            return
        link = self._links.get(ident)
        if link is not None and link.nonce != frame.nonce:
            self._lose(link)
            link = None
        if link is None:
            link = self._new_link(ident, NODE, peer.name, budget)
            if link is None:
                return
            link.nonce = frame.nonce
            link.capacity = frame.capacity
            link.capacity_bytes = frame.capacity_bytes
        link.heard = now
        if link.receivers != frame.receivers:
            link.receivers = frame.receivers
        self._announce()

    def _new_link(self, ident: bytes, role: bytes, name: str, budget: Budget) -> Link | None:
        """A new link of child node or receiver ``name`` on connection ``ident``; it replaces
        the older link of that name (a restarted peer, a new connection of its key), never
        another name's.  ``None``: the node tracks ``max_peers`` already."""
        old = self._named.get((role, name))
        if old is not None and old in self._links:
            self._lose(self._links[old])
        if len(self._clients) + len(self._links) >= self.config.max_peers:
            self.drops["peers"] += 1
            return None
        link = self._links[ident] = Link(
            ident=ident, role=role, name=name, budget=budget, nonce=0, capacity=1,
            capacity_bytes=1, receivers=frozenset(), heard=0.0,
        )  # fmt: skip
        self._named[(role, name)] = ident
        budget.users += 1
        return link

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
        if self._named.get((link.role, link.name)) == link.ident:
            del self._named[(link.role, link.name)]
        link.budget.users -= 1
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
            busy = client.offers > 0
            if silent > (timeout if busy else 10 * timeout):
                self._forget_client(client.ident)
        self._expire_grants(now)
        self._collect(now)
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
    security: Security | None = None,
) -> dict[str, RelayNode]:
    """Start a balanced tree of relay nodes in ``tg`` (parents first); ``names[0]`` is the root.
    With ``security`` keys every node is ``relay:<name>`` (the key directory holds them)."""
    parents = balanced_tree(names, fanout)
    nodes: dict[str, RelayNode] = {}
    for name in names:
        parent = parents[name]
        node = RelayNode(
            name,
            bind=f"tcp://{host}:0",
            parent=None if parent is None else nodes[parent].address,
            parent_name=parent,
            config=config,
            context=context,
            security=security,
        )
        await tg.start(node.serve)
        nodes[name] = node
    return nodes
