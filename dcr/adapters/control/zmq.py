"""A ZeroMQ control channel: coordinator -> endpoint calls and replies between processes.

A coordinator link binds a ROUTER (``tcp://127.0.0.1:<random port>`` by default) whose address
the coordinator engine writes into the commit record with its epoch.  An endpoint link is a
DEALER whose routing id is the endpoint's name, connected to the *current* coordinator: a fixed
``address``, or the one the commit store names (``store``, read every ``watch_s``).  When the
store names a new epoch at a new address (a standby took over), the endpoint says goodbye to
the old coordinator, connects to the new one and says hello there; from then on it refuses
calls of older epochs (:meth:`~dcr.adapters.control.base.EndpointLink.admit`).

Connection bookkeeping, kept small and explicit:

* an endpoint sends :class:`Hello` (with its last :class:`~dcr.protocol.messages.EndpointStatus`)
  when it connects and then every ``ping_s`` as its heartbeat, and :class:`Bye` when it closes;
* the coordinator delivers calls only to endpoints that said hello; calls to any other name
  wait in a queue of at most ``pending_calls`` per endpoint (the oldest is dropped and counted)
  and leave, in order, with the endpoint's next hello;
* the coordinator sends :class:`Ping` to each connected endpoint every ``ping_s``.  With
  ``ROUTER_MANDATORY`` a send to a peer whose TCP connection is gone fails at once, so a
  SIGKILLed endpoint is noticed within one interval; an endpoint silent for ``peer_timeout_s``
  counts as gone too.  ``ROUTER_HANDOVER`` lets a restarted endpoint take over its name.
  ZeroMQ's own heartbeats drop connections to hosts that vanished without closing them.

Replies go to the one coordinator the endpoint is connected to (the one its configuration or
the commit store names).  A call sent in the instant its endpoint dies can be lost; the cores
tolerate lost messages.  Every received frame goes through
:class:`~dcr.adapters.control.codec.ControlCodec`;
a frame that fails to decode, has the wrong number of
parts, arrives in the wrong direction (a call at a coordinator, a reply at an endpoint) or, at
a coordinator, names a sender other than its connection's routing id is dropped, changes
nothing, and is counted in the receiving link's ``drops``:

* both ends: the codec's ``check`` (``oversized``, ``truncated``, ``malformed``, ``version``,
  ``type``, ``schema``), ``parts``, ``direction``, ``closed`` (used after ``aclose``);
* coordinator: ``sender``, ``pending-overflow`` (a waiting call dropped for a newer one),
  ``overflow`` (a reply dropped because ``replies_buffer`` replies were not read);
* endpoint: ``stale-epoch``, ``unsent`` (the send queue was full), ``no-coordinator`` (no
  address known yet), ``address`` (the store named an address that cannot be connected to),
  ``store`` (a failed store read).

Optional CURVE encryption and authentication (:class:`CurveConfig`, key files made with
``zmq.auth.create_certificates``) is checked by an in-process ZAP handler: an endpoint whose
public key is not in ``authorized_clients_dir`` never completes its connection.  pyzmq's
asyncio sockets need the asyncio backend of anyio.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import zmq
import zmq.asyncio
import zmq.auth
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from zmq.utils import z85

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.context import dataclass_options
from dcr.adapters.control.base import (
    PENDING_CALLS,
    ControlChannel,
    CoordinatorLink,
    EndpointLink,
)
from dcr.adapters.control.codec import MAX_BYTES, ControlCodec
from dcr.errors import CommitStoreError, ConfigError, ControlMessageRejected, LocalProtocolError
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = [
    "COORDINATOR",
    "LINK_MESSAGES",
    "Bye",
    "CurveConfig",
    "Hello",
    "Ping",
    "ZmqControl",
    "ZmqControlConfig",
    "ZmqCoordinatorLink",
    "ZmqEndpointLink",
]

COORDINATOR = "coordinator"
"""Sender name of frames from a coordinator link."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"dcr-control"
_BYE_LINGER_MS = 100
"""How long a closing endpoint socket may hold its goodbye (ZeroMQ waits for it only when
the coordinator is unreachable)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Endpoint -> coordinator on connecting and every ping interval: deliver my calls.

    ``status`` is the endpoint's last reported status (``None`` before its first)."""

    status: msg.EndpointStatus | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """Endpoint -> coordinator: this link closes; queue later calls for the name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """Coordinator -> endpoint every ping interval: a failing send shows the endpoint gone."""


LINK_MESSAGES: tuple[type, ...] = (Hello, Bye, Ping)
"""Connection bookkeeping of this channel, encoded by the same codec as the calls."""


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


def _routing_id(name: str) -> bytes:
    """An endpoint's routing id: its UTF-8 name (1-255 bytes, not starting with a zero byte,
    which ZeroMQ reserves for ids it generates)."""
    try:
        ident = name.encode()
    except UnicodeEncodeError:
        ident = b""
    if not 0 < len(ident) <= 255 or ident[0] == 0:
        raise ConfigError(f"control endpoint name {name!r} must be 1 to 255 UTF-8 bytes")
    return ident


def _load_keys(path: str | Path | None, what: str, *, secret: bool) -> tuple[bytes, bytes]:
    if path is None:
        raise ConfigError(f"CURVE needs the {what}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the {what} {str(path)!r}: {exc}") from exc
    if secret and secret_key is None:
        raise ConfigError(f"the {what} {str(path)!r} holds no secret key")
    return public, secret_key or b""


def _authorized(directory: str | Path | None) -> frozenset[bytes]:
    if directory is None:
        raise ConfigError("CURVE needs authorized_clients_dir")
    if not Path(directory).is_dir():
        raise ConfigError(f"authorized_clients_dir {str(directory)!r} is not a directory")
    try:
        return frozenset(zmq.auth.load_certificates(directory))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the certificates in {str(directory)!r}: {exc}") from exc


def _set_options(sock: zmq.asyncio.Socket, config: ZmqControlConfig) -> None:
    """Options every control socket shares: no linger, bounds, reconnects, ZMTP heartbeats."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.hwm)
    sock.setsockopt(zmq.RCVHWM, config.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(config.ping_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(config.peer_timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(config.peer_timeout_s * 1000))))


def _send_now(sock: zmq.asyncio.Socket, parts: Sequence[bytes]) -> int:
    """Send without waiting; 0 when sent, else the errno (``EHOSTUNREACH``: the peer is not
    connected, ``EAGAIN``: its queue is full)."""
    future = cast(
        "asyncio.Future[object]", sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=True)
    )
    if not future.done():  # pyzmq completes a NOBLOCK send at once
        future.cancel()
        return zmq.EAGAIN
    exc = future.exception()
    if exc is None:
        return 0
    return (exc.errno or zmq.EFAULT) if isinstance(exc, zmq.ZMQError) else zmq.EFAULT


class _Tasks:
    """Background asyncio tasks of one link; ``failure`` keeps the first unexpected error,
    and ``on_failure`` ends the link's iteration so that its reader sees the error."""

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        self.on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.failure is None:
            self.failure = task.exception()
        self.on_failure()

    async def cancel(self, tasks: Sequence[asyncio.Task[None]] | None = None) -> None:
        todo = list(self.tasks if tasks is None else tasks)
        for task in todo:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*todo, return_exceptions=True)

    def check(self) -> None:
        """Raise the background failure that ended the link, if any."""
        if self.failure is not None:
            raise LocalProtocolError(
                f"the control link failed: {self.failure!r}", check="link"
            ) from self.failure


class ZmqEndpointLink(EndpointLink):
    """A DEALER (routing id = the endpoint's name) to the current coordinator."""

    def __init__(self, control: ZmqControl, name: str) -> None:
        super().__init__(name)
        self._control = control
        self._ident = _routing_id(name)
        self._config = control.config
        self.address = ""
        """The coordinator address this link is connected to (empty: none known yet)."""
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._store_epoch = 0
        self._closed = False
        self._send: MemoryObjectSendStream[tuple[int, msg.Call]]
        self._recv: MemoryObjectReceiveStream[tuple[int, msg.Call]]
        self._send, self._recv = anyio.create_memory_object_stream[tuple[int, msg.Call]](
            self._config.pending_calls
        )
        self._tasks = _Tasks(self._send.close)

    async def open(self) -> None:
        """Connect to the configured address or the store's coordinator; start heartbeats."""
        control = self._control
        if control.address is not None:
            self._connect(control.address)
        elif control.store is not None:
            await self._follow(raising=True)
            self._tasks.spawn(self._watch())
        self._tasks.spawn(self._beat())

    # -- sending ------------------------------------------------------------------------------

    def _emit(self, message: object) -> None:
        if self._sock is None:
            self.drops["no-coordinator"] += 1
            return
        data = self._control.codec.encode(message, epoch=self.epoch, sender=self.name)
        if _send_now(self._sock, [data]) != 0:
            self.drops["unsent"] += 1

    async def notify(self, reply: msg.Reply) -> None:
        if self._closed:
            self.drops["closed"] += 1
            return
        self._emit(reply)

    async def _beat(self) -> None:
        while True:
            await anyio.sleep(self._config.ping_s)
            if self._sock is not None:
                self._emit(Hello(status=self.status))

    # -- connecting ---------------------------------------------------------------------------

    def _connect(self, address: str) -> None:
        """Replace the connection by one to ``address`` and say hello there.

        Synchronous on purpose: no cancellation can leave a socket half-owned."""
        control = self._control
        sock = control.context().socket(zmq.DEALER)
        try:
            _set_options(sock, self._config)
            sock.setsockopt(zmq.ROUTING_ID, self._ident)
            control._curve_client(sock)
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"cannot connect to the coordinator at {address!r}: {exc}") from exc
        except BaseException:
            sock.close(linger=0)
            raise
        self._disconnect()
        self._sock, self.address = sock, address
        self._reader = self._tasks.spawn(self._read(sock))
        self._emit(Hello(status=self.status))

    def _disconnect(self) -> None:
        """Say goodbye to the current coordinator, stop reading and close the socket (the
        goodbye may still leave within a short linger)."""
        sock, reader = self._sock, self._reader
        self._sock = self._reader = None
        if reader is not None:
            reader.cancel()
        if sock is not None:
            _send_now(sock, [self._control.codec.encode(Bye(), epoch=self.epoch, sender=self.name)])
            sock.close(linger=_BYE_LINGER_MS)

    async def _watch(self) -> None:
        while True:
            await anyio.sleep(self._config.watch_s)
            await self._follow(raising=False)

    async def _follow(self, *, raising: bool) -> None:
        """Read the commit record; connect to a coordinator that claimed a newer epoch."""
        assert self._control.store is not None
        try:
            state = await self._control.store.read()
        except CommitStoreError:
            if raising:
                raise
            self.drops["store"] += 1
            return
        if state.epoch < self._store_epoch:
            return
        self._store_epoch = state.epoch
        self.epoch = max(self.epoch, state.epoch)
        if not state.address or state.address == self.address:
            return
        try:
            self._connect(state.address)
        except ConfigError:
            if raising:
                raise
            self.drops["address"] += 1

    # -- receiving ----------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        codec = self._control.codec
        while True:
            parts = await sock.recv_multipart(copy=False)
            if len(parts) != 1:
                self.drops["parts"] += 1
                continue
            try:
                envelope = codec.decode(parts[0].buffer)
            except ControlMessageRejected as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            message = envelope.message
            if isinstance(message, msg.CALLS):
                await self._send.send((envelope.epoch, message))
            elif not isinstance(message, Ping):
                self.drops["direction"] += 1

    async def calls(self) -> AsyncIterator[msg.Call]:
        while True:
            try:
                epoch, message = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._tasks.check()
                return
            if self.admit(epoch):
                yield message

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control._forget(self)
        try:
            await self._tasks.cancel()
        finally:
            self._disconnect()
            self._send.close()
            self._recv.close()


@dataclass(slots=True)
class _Peer:
    """A connected endpoint as its coordinator link sees it."""

    status: msg.EndpointStatus | None
    heard: float


class ZmqCoordinatorLink(CoordinatorLink):
    """A ROUTER that endpoints connect to; the address goes into the commit record."""

    def __init__(self, control: ZmqControl) -> None:
        super().__init__()
        self._control = control
        self._config = control.config
        self._router: zmq.asyncio.Socket | None = None
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[str, deque[bytes]] = {}
        self._epoch = 0
        self._closed = False
        self._send: MemoryObjectSendStream[msg.Reply]
        self._recv: MemoryObjectReceiveStream[msg.Reply]
        self._send, self._recv = anyio.create_memory_object_stream[msg.Reply](
            self._config.replies_buffer
        )
        self._tasks = _Tasks(self._send.close)

    async def open(self) -> None:
        control = self._control
        sock = control.context().socket(zmq.ROUTER)
        try:
            _set_options(sock, self._config)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            control._curve_server(sock)
            self.address = _bind(sock, self._config.bind)
        except BaseException:
            sock.close(linger=0)
            raise
        self._router = sock
        self._tasks.spawn(self._read(sock))
        self._tasks.spawn(self._tick())

    # -- what the coordinator sees ------------------------------------------------------------

    def endpoints(self) -> dict[str, msg.EndpointStatus | None]:
        """Connected endpoints and the last status each reported (``None``: none yet)."""
        return {name: peer.status for name, peer in self._peers.items()}

    def pending(self, endpoint: str) -> int:
        """Calls waiting for ``endpoint`` to connect."""
        return len(self._pending.get(endpoint, ()))

    # -- calls --------------------------------------------------------------------------------

    async def call(self, endpoint: str, message: msg.Call, *, epoch: int) -> None:
        _routing_id(endpoint)
        data = self._control.codec.encode(message, epoch=epoch, sender=COORDINATOR)
        if self._closed:
            self.drops["closed"] += 1
            return
        self._epoch = max(self._epoch, epoch)
        if endpoint in self._peers:
            self._flush(endpoint)
            if endpoint not in self._pending and self._deliver(endpoint, data):
                return
        queue = self._pending.setdefault(endpoint, deque())
        if len(queue) >= self._config.pending_calls:
            queue.popleft()
            self.drops["pending-overflow"] += 1
        queue.append(data)

    def _deliver(self, endpoint: str, data: bytes) -> bool:
        """Send one frame to a connected endpoint; a peer that is gone is forgotten."""
        assert self._router is not None
        errno = _send_now(self._router, [_routing_id(endpoint), data])
        if errno == 0:
            return True
        if errno != zmq.EAGAIN:
            self._peers.pop(endpoint, None)
        return False

    def _flush(self, endpoint: str) -> None:
        """Send the calls waiting for ``endpoint``, oldest first, while it takes them."""
        queue = self._pending.get(endpoint)
        while queue and endpoint in self._peers and self._deliver(endpoint, queue[0]):
            queue.popleft()
        if queue is not None and not queue:
            del self._pending[endpoint]

    # -- receiving ----------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        codec = self._control.codec
        while True:
            parts = await sock.recv_multipart(copy=False)
            if len(parts) != 2:
                self.drops["parts"] += 1
                continue
            try:
                envelope = codec.decode(parts[1].buffer)
            except ControlMessageRejected as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            try:
                name = parts[0].bytes.decode()
            except UnicodeDecodeError:
                name = ""
            if envelope.sender != name:
                self.drops["sender"] += 1
                continue
            self._on_message(name, envelope.message)

    def _on_message(self, name: str, message: object) -> None:
        now = time.monotonic()
        peer = self._peers.get(name)
        if isinstance(message, Hello):
            if peer is None:
                self._peers[name] = _Peer(status=message.status, heard=now)
                if message.status is not None:
                    self._push(message.status)
            else:
                peer.heard = now
                if message.status is not None and message.status != peer.status:
                    peer.status = message.status
                    self._push(message.status)
            self._flush(name)
        elif isinstance(message, Bye):
            self._peers.pop(name, None)
        elif isinstance(message, msg.REPLIES):
            if peer is not None:
                peer.heard = now
                if isinstance(message, msg.EndpointStatus):
                    peer.status = message
            self._push(message)
        else:
            self.drops["direction"] += 1

    def _push(self, reply: msg.Reply) -> None:
        try:
            self._send.send_nowait(reply)
        except anyio.WouldBlock:
            self.drops["overflow"] += 1
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.drops["closed"] += 1

    async def _tick(self) -> None:
        """Ping connected endpoints, forget silent or unreachable ones, retry waiting calls."""
        codec = self._control.codec
        while True:
            await anyio.sleep(self._config.ping_s)
            ping = codec.encode(Ping(), epoch=self._epoch, sender=COORDINATOR)
            now = time.monotonic()
            for name, peer in list(self._peers.items()):
                if now - peer.heard > self._config.peer_timeout_s:
                    del self._peers[name]
                elif self._deliver(name, ping):
                    self._flush(name)

    async def replies(self) -> AsyncIterator[msg.Reply]:
        while True:
            try:
                yield await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._tasks.check()
                return

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control._forget(self)
        try:
            await self._tasks.cancel()
        finally:
            if self._router is not None:
                self._router.close(linger=0)
                self._router = None
            self._peers.clear()
            self._send.close()
            self._recv.close()


def _bind(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; a port of ``0`` picks a free one.  Returns the bound address."""
    try:
        if address.startswith("tcp://") and address.endswith(":0"):
            host = address[: -len(":0")]
            return f"{host}:{sock.bind_to_random_port(host)}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind the control address {address!r}: {exc}") from exc
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


class ZmqControl(ControlChannel):
    """The control channel of one process over ZeroMQ (asyncio backend only).

    A coordinator process opens :meth:`coordinator` (a ROUTER bound at ``config.bind``);
    an owner or receiver process opens :meth:`endpoint` and finds its coordinator at
    ``address`` or, when that is ``None``, in the commit record of ``store``.  ``context``
    is shared and left open; without one the channel owns a context and terminates it in
    :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        store: CommitStore | None = None,
        config: ZmqControlConfig | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.store = store
        self.config = config or ZmqControlConfig()
        self.codec = ControlCodec(
            (*msg.MESSAGES, *LINK_MESSAGES), max_bytes=self.config.max_message_bytes
        )
        self.auth: Counter[str] = Counter()
        """ZAP decisions of this process's CURVE handler: ``allowed`` and ``denied``."""
        self._context = context
        self._own_context = context is None
        self._endpoints: dict[str, ZmqEndpointLink] = {}
        self._coordinators: set[ZmqCoordinatorLink] = set()
        self._zap: asyncio.Task[None] | None = None
        self._zap_sock: zmq.asyncio.Socket | None = None
        self._closed = False

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The channel of one fleet process: endpoints find the coordinator through the
        commit record (``context.store``), coordinators bind ``bind`` (default
        ``tcp://<fleet host>:0``).  The keys are :class:`ZmqControlConfig` fields; ``curve``
        is a table of :class:`CurveConfig` key files, relative to the fleet file."""
        if context.store is None:
            raise ConfigError(
                f"[{context.section}]: the ZeroMQ control channel finds the coordinator "
                "through the commit store, and none was given"
            )
        opts = dict(options)
        curve = opts.pop("curve", None)
        opts.setdefault("bind", f"tcp://{context.host}:0")
        config: ZmqControlConfig = dataclass_options(ZmqControlConfig, opts, context.section)
        if curve is not None:
            where = f"{context.section}.curve"
            if not isinstance(curve, Mapping):
                raise ConfigError(f"[{where}] must be a table of key files")
            files = {k: str(context.path(v)) for k, v in curve.items()}
            config = replace(config, curve=dataclass_options(CurveConfig, files, where))
        return cls(store=context.store, config=config)

    def context(self) -> zmq.asyncio.Context:
        """The ZeroMQ context (created on first use)."""
        if self._closed:
            raise ConfigError("the control channel is closed")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        return self._context

    async def endpoint(self, name: str) -> ZmqEndpointLink:
        if self.address is None and self.store is None:
            raise ConfigError("an endpoint needs a coordinator address or a commit store")
        if name in self._endpoints:
            raise ConfigError(f"an endpoint named {name!r} is already open")
        link = ZmqEndpointLink(self, name)
        self._endpoints[name] = link
        try:
            await link.open()
        except BaseException:
            await link.aclose()
            raise
        return link

    async def coordinator(self) -> ZmqCoordinatorLink:
        link = ZmqCoordinatorLink(self)
        self._coordinators.add(link)
        try:
            await link.open()
        except BaseException:
            await link.aclose()
            raise
        return link

    def _forget(self, link: ZmqEndpointLink | ZmqCoordinatorLink) -> None:
        """A link closed; its name may be opened again."""
        if isinstance(link, ZmqEndpointLink):
            if self._endpoints.get(link.name) is link:
                del self._endpoints[link.name]
        else:
            self._coordinators.discard(link)

    # -- CURVE ----------------------------------------------------------------------------------

    def _curve_client(self, sock: zmq.asyncio.Socket) -> None:
        """Make ``sock`` a CURVE client when CURVE is configured."""
        curve = self.config.curve
        if curve is None:
            return
        public, secret = _load_keys(curve.client_secret_file, "client secret file", secret=True)
        server, _ = _load_keys(curve.server_public_file, "server public file", secret=False)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)

    def _curve_server(self, sock: zmq.asyncio.Socket) -> None:
        """Make ``sock`` a CURVE server checked by this process's ZAP handler."""
        curve = self.config.curve
        if curve is None:
            return
        public, secret = _load_keys(curve.server_secret_file, "server secret file", secret=True)
        allowed = _authorized(curve.authorized_clients_dir)
        if self._zap is None:
            self._start_zap(allowed)
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def _start_zap(self, allowed: frozenset[bytes]) -> None:
        sock = self.context().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"this ZeroMQ context already has a ZAP handler: {exc}") from exc
        self._zap_sock = sock
        self._zap = asyncio.get_running_loop().create_task(self._serve_zap(sock, allowed))

    async def _serve_zap(self, sock: zmq.asyncio.Socket, allowed: frozenset[bytes]) -> None:
        """Answer ZAP requests (RFC 27): CURVE clients whose public key is authorized pass."""
        while True:
            request = await sock.recv_multipart()
            version, request_id = [*request, b"", b""][:2]
            ok = (
                len(request) >= 7
                and version == b"1.0"
                and request[2] == _ZAP_DOMAIN
                and request[5] == b"CURVE"
                and len(request[6]) == 32
                and z85.encode(request[6]) in allowed
            )
            self.auth["allowed" if ok else "denied"] += 1
            status = [b"200", b"OK"] if ok else [b"400", b"not authorized"]
            await sock.send_multipart([b"1.0", request_id, *status, b"", b""])

    async def aclose(self) -> None:
        """Close every link this channel opened, the ZAP handler and an owned context."""
        self._closed = True
        links: list[ZmqEndpointLink | ZmqCoordinatorLink] = [
            *self._endpoints.values(),
            *self._coordinators,
        ]
        try:
            for link in links:
                await link.aclose()
            if self._zap is not None:
                self._zap.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(self._zap, return_exceptions=True)
        finally:
            self._zap = None
            if self._zap_sock is not None:
                self._zap_sock.close(linger=0)
                self._zap_sock = None
            if self._own_context and self._context is not None:
                # destroy, not term: it also closes a socket an interrupted close left open
                self._context.destroy()
                self._context = None
