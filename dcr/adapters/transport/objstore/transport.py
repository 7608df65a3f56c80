"""The object-storage transport object: one per process, composing the owner side
(:mod:`~dcr.adapters.transport.objstore.sender`) and the rollout node's fetches
(:mod:`~dcr.adapters.transport.objstore.fetcher`) over one backend
(:mod:`~dcr.adapters.transport.objstore.storage`).  Uploads and fetches pass through the
process's emulated link (:mod:`dcr.adapters.transport.link`, ``link_gbps``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import anyio

from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore.backend import ObjectBackend
from dcr.adapters.transport.objstore.config import ObjectStoreConfig
from dcr.adapters.transport.objstore.fetcher import Fetcher
from dcr.adapters.transport.objstore.sender import Sender
from dcr.adapters.transport.objstore.storage import FetchStats, Storage
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["ObjectStoreTransport"]


class ObjectStoreTransport(Transport):
    """The object-storage transport over ``backend`` (which it owns and closes).

    One object per process: owners send through it, the coordinator stops and cleans up
    through it, and the receivers of the process subscribe to it -- the process is one
    rollout node, whose fetches its receivers share (each payload fetched once, handed to
    every subscribed receiver it is meant for).  :meth:`stats` counts uploads (what this
    object sent), :meth:`fetch_stats` what it fetched.
    """

    def __init__(self, backend: ObjectBackend, config: ObjectStoreConfig | None = None) -> None:
        config = config or ObjectStoreConfig()
        self.arrival_grace_s = config.arrival_grace_s
        self.receiver_window = config.receiver_window
        self.writer = uuid.uuid4().hex[:16]
        """This object's name in object keys."""
        self.uplink = LinkLimit(config.link_gbps)
        self.downlink = LinkLimit(config.link_gbps)
        self._closed = False
        self._storage = Storage(backend, config)
        self._sender = Sender(self._storage, self.writer, self.uplink)
        self._fetcher = Fetcher(self._storage, self.downlink, self._sender.stopped)

    @property
    def config(self) -> ObjectStoreConfig:
        """The settings every later operation reads (the links and the node cache keep
        those they were made with)."""
        return self._storage.config

    @config.setter
    def config(self, config: ObjectStoreConfig) -> None:
        self._storage.config = config

    @property
    def backend(self) -> ObjectBackend:
        """The store every operation goes to (a wrapper may replace it before first use)."""
        return self._storage.backend

    @backend.setter
    def backend(self, backend: ObjectBackend) -> None:
        self._storage.backend = backend

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                "the object-store transport is closed", retryable=False, check="closed"
            )

    # -- Transport: sending -----------------------------------------------------------------

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        """Upload the payload, then post its manifest entry (paper App. C: ``put`` +
        ``post_manifest``); returns once both are stored."""
        self._check_open()
        if await self._sender.send(key, data, to=to):
            self._fetcher.nudge()  # this process's node lists the manifests sooner

    async def stop_and_wait(self, attempt: int) -> None:
        """Write the attempt's tombstone (no sender uploads or posts for it any more, no node
        fetches it) and wait for this process's sends of it."""
        self._check_open()
        self._stop_here(attempt)
        await self._sender.stop_and_wait(attempt)

    async def cleanup(self, attempt: int) -> None:
        """Stop the attempt, delete its objects, abort its incomplete uploads; then sweep
        attempts whose tombstones outlived ``tombstone_ttl_s``.

        Once begun, a cleanup runs to its end even when its caller is cancelled (a
        coordinator ends its transition right after asking for it), bounded by
        ``cleanup_timeout_s``: a cleanup cut short would leave objects behind.
        """
        self._check_open()
        self._stop_here(attempt)
        await self._sender.cleanup(attempt)

    def _stop_here(self, attempt: int) -> None:
        self._sender.stopped.add(attempt)
        self._fetcher.drop_fetches(attempt)

    async def purge(self) -> None:
        """Delete every payload, manifest entry and tombstone under the store's root and
        abort incomplete uploads: a fresh start for a fleet whose attempt ids begin again
        (never while a fleet uses the store)."""
        await self._sender.purge()

    # -- Transport: receiving ---------------------------------------------------------------

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        self._check_open()
        return self._fetcher.subscribe(receiver)

    def unsubscribe(self, receiver: str) -> None:
        self._fetcher.unsubscribe(receiver)

    async def taken(self, receiver: str, key: PayloadKey) -> None:
        await self._fetcher.taken(receiver, key)

    def stats(self) -> TransportStats:
        """Payloads this object uploaded (every send in ``cross_bytes``, each key once in
        ``payload_bytes``)."""
        return self._sender.sent

    def fetch_stats(self) -> FetchStats:
        """What this node fetched for its receivers."""
        return self._storage.fetched

    async def aclose(self) -> None:
        """Cancel polling and fetches, end every subscription, close the backend."""
        if self._closed:
            return
        self._closed = True
        tasks = self._fetcher.close()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.backend.aclose()
