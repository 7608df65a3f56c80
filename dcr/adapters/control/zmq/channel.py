"""The ZeroMQ control channel of one process (:class:`ZmqControl`): opens its endpoint and
coordinator links with the fleet's keys, and builds itself from a fleet file."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

import zmq.asyncio

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.context import dataclass_options
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.control.codec import ControlCodec
from dcr.adapters.control.zmq.config import ZmqControlConfig
from dcr.adapters.control.zmq.coordinator import ZmqCoordinatorLink
from dcr.adapters.control.zmq.endpoint import ZmqEndpointLink
from dcr.adapters.control.zmq.link import LINK_MESSAGES
from dcr.adapters.security import Security, auth_counts
from dcr.errors import ConfigError
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext


class ZmqControl(ControlChannel):
    """The control channel of one process over ZeroMQ (asyncio backend only).

    A coordinator process opens :meth:`coordinator` (a ROUTER bound at ``config.bind``);
    an owner or receiver process opens :meth:`endpoint` and finds its coordinator at
    ``address`` or, when that is ``None``, in the commit record of ``store``.  With keys
    (``security``), every connection is CURVE: the coordinator is ``coordinator:main`` and an
    endpoint named ``n`` is ``owner:n`` or ``receiver:n`` of the keyring.  ``context`` is
    shared and left open; without one the channel owns a context and terminates it in
    :meth:`aclose`.
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        store: CommitStore | None = None,
        config: ZmqControlConfig | None = None,
        security: Security | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.address = address
        self.security = security or Security()
        self.store = store
        self.config = config or ZmqControlConfig()
        self.codec = ControlCodec(
            (*msg.MESSAGES, *LINK_MESSAGES), max_bytes=self.config.max_message_bytes
        )
        self._context = context
        self._own_context = context is None
        self._endpoints: dict[str, ZmqEndpointLink] = {}
        self._coordinators: set[ZmqCoordinatorLink] = set()
        self._closed = False

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The channel of one fleet process: endpoints find the coordinator through the
        commit record (``context.store``), coordinators bind ``bind`` (default
        ``tcp://<fleet host>:0``).  The keys are :class:`ZmqControlConfig` fields; the key
        material is the fleet's (``context.security``)."""
        if context.store is None:
            raise ConfigError(
                f"[{context.section}]: the ZeroMQ control channel finds the coordinator "
                "through the commit store, and none was given"
            )
        opts = dict(options)
        if "curve" in opts:
            raise ConfigError(
                f"[{context.section}] curve is gone: CURVE keys are the fleet's now "
                '(`dcr keys init DIR`, then [fleet] keys = "DIR"); see docs/security.md'
            )
        opts.setdefault("bind", f"tcp://{context.host}:0")
        config: ZmqControlConfig = dataclass_options(ZmqControlConfig, opts, context.section)
        return cls(store=context.store, config=config, security=context.security)

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

    @property
    def auth(self) -> Counter[str]:
        """ZAP decisions of this process's context: ``allowed`` and ``denied`` connections."""
        return auth_counts(self._context) if self._context is not None else Counter()

    async def aclose(self) -> None:
        """Close every link this channel opened and an owned context."""
        self._closed = True
        links: list[ZmqEndpointLink | ZmqCoordinatorLink] = [
            *self._endpoints.values(),
            *self._coordinators,
        ]
        try:
            for link in links:
                await link.aclose()
        finally:
            if self._own_context and self._context is not None:
                # destroy, not term: it also closes a socket an interrupted close left open
                self._context.destroy()
                self._context = None
