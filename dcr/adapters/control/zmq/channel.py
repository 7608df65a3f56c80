"""The ZeroMQ control channel of one process (:class:`ZmqControl`): opens its endpoint and
coordinator links, builds it from a fleet file, and answers CURVE authentication (ZAP)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Self

import anyio
import zmq
import zmq.asyncio
from zmq.utils import z85

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.context import dataclass_options
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.control.codec import ControlCodec
from dcr.adapters.control.zmq.config import (
    CurveConfig,
    ZmqControlConfig,
    authorized_keys,
    load_keys,
)
from dcr.adapters.control.zmq.coordinator import ZmqCoordinatorLink
from dcr.adapters.control.zmq.endpoint import ZmqEndpointLink
from dcr.adapters.control.zmq.link import LINK_MESSAGES
from dcr.errors import ConfigError
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"dcr-control"


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
        public, secret = load_keys(curve.client_secret_file, "client secret file", secret=True)
        server, _ = load_keys(curve.server_public_file, "server public file", secret=False)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)

    def _curve_server(self, sock: zmq.asyncio.Socket) -> None:
        """Make ``sock`` a CURVE server checked by this process's ZAP handler."""
        curve = self.config.curve
        if curve is None:
            return
        public, secret = load_keys(curve.server_secret_file, "server secret file", secret=True)
        allowed = authorized_keys(curve.authorized_clients_dir)
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
