"""The receiver side of the object-storage transport: a rollout node lists the manifests, fetches
every payload listed for its subscribed receivers with a bounded number of concurrent GETs, and
hands each to the receivers it is meant for, each owner's payloads in the order they were sent
(paper §7.1 "Object storage", App. B "Transports").

**Arrival check** (App. B.1, flush).  ``send`` returns once the payload and its manifest entry
are stored, so the owners' declared counts are the manifest, and a receiver's arrival check
-- every declared payload arrived within ``arrival_grace_s`` -- is "every manifest entry
fetched and verified".  Each fetched payload's length is checked against its entry: a cut
connection is fetched again, while an object that stays shorter or longer than its entry is
handed over as stored, so the receiver's strict decoder fails the attempt at once instead of
waiting out the arrival grace.  A payload missing from storage is not delivered (the arrival
check fails the attempt).  A manifest entry is read the same way: a read whose length differs
from the entry's size in the listing is tried again, and the entry is decided on only from a
complete read (a short read that was taken for a damaged entry would hide its payload until
the arrival grace ran out).  Fetches run as background tasks on asyncio (like aiobotocore
itself).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from dcr.adapters.transport.base import Deliveries, Delivery
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.nodeshare import NodeFetches
from dcr.adapters.transport.objstore.config import ObjectStoreConfig
from dcr.adapters.transport.objstore.layout import (
    ENTRY_FORMAT,
    MANIFEST,
    MANIFEST_RE,
    ManifestEntry,
    decode_entry,
    owner_name,
    payload_key,
)
from dcr.adapters.transport.objstore.storage import Storage
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Fetcher"]


@dataclass(eq=False)
class _Sub:
    """One subscribed receiver: its :class:`~dcr.adapters.transport.base.Inbox` and the
    window slots its deliveries hold (``untaken``) or its running fetches reserve."""

    name: str
    inbox: deque[Delivery] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)
    untaken: int = 0
    reserved: int = 0
    closed: bool = False

    def room(self, window: int) -> bool:
        return self.closed or self.untaken + self.reserved < window


@dataclass(eq=False)
class _Fetch:
    """One manifest entry on its way to a node's receivers."""

    key: PayloadKey
    obj: str
    size: int
    recipients: list[_Sub]
    addressed: bool = False
    """Its manifest entry names its receivers (``to``)."""
    state: str = "queued"
    """``queued`` -> ``fetching`` -> ``done`` (or ``queued`` -> ``done``: dropped)."""
    dispatched: bool = False
    """A GET started for it: a window slot of each recipient is reserved until hand-over."""
    data: bytes | None = None


class Fetcher:
    """The fetches of one rollout node (one transport object) for its subscribed receivers:
    each payload fetched once, handed to every subscribed receiver it is meant for, each
    receiver holding at most ``receiver_window`` deliveries it did not take.

    ``stopped`` is the sending side's set of attempts stopped here (shared, not copied):
    they are never fetched, nor are attempts with a tombstone in storage.
    """

    def __init__(self, storage: Storage, downlink: LinkLimit, stopped: set[int]) -> None:
        self.storage = storage
        self.downlink = downlink
        # storage operations and counters, shared with the sending side
        self._count = storage.count
        self._retry = storage.retry
        self._list = storage.list
        self._backoff = storage.backoff
        self._stopped = stopped
        self.closed = False
        self._subs: dict[str, _Sub] = {}
        self._known: set[str] = set()
        """Manifest entries already taken into account (queued, delivered or ignored)."""
        self._streams: dict[tuple[int, str, str], deque[_Fetch]] = {}
        self._remote_stopped: set[int] = set()
        self._fetching = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._nudge = anyio.Event()
        self._fetched_keys: set[PayloadKey] = set()
        self._node = NodeFetches(self.config.node_cache) if self.config.node_cache else None

    @property
    def config(self) -> ObjectStoreConfig:
        return self.storage.config

    def nudge(self) -> None:
        """List the manifests now (a payload was just sent from this process)."""
        self._nudge.set()

    def close(self) -> list[asyncio.Task[None]]:
        """End every subscription and cancel polling and fetches; the tasks to wait for."""
        self.closed = True
        for sub in self._subs.values():
            sub.closed = True
            sub.wake.set()
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError as exc:
            coro.close()
            raise TransportError(
                "the object-store transport runs on asyncio", retryable=False, check="backend"
            ) from exc
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[None]) -> None:
        """A background task ended; an unexpected error is counted, not lost."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._count(errors=1, last_error=f"{type(exc).__name__}: {exc}")

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        if receiver in self._subs:
            raise TransportError(
                f"{receiver!r} is already subscribed", retryable=False, check="subscribe"
            )
        sub = self._subs[receiver] = _Sub(receiver)
        if self._poller is None or self._poller.done():
            self._poller = self.spawn(self._poll())
        self._nudge.set()
        return Deliveries(sub)

    def unsubscribe(self, receiver: str) -> None:
        sub = self._subs.pop(receiver, None)
        if sub is None:
            return
        sub.closed = True
        sub.wake.set()
        self._dispatch()

    async def taken(self, receiver: str, key: PayloadKey) -> None:
        sub = self._subs.get(receiver)
        if sub is not None and sub.untaken:
            sub.untaken -= 1
            self._dispatch()

    async def _poll(self) -> None:
        """List the manifests every ``poll_s`` (sooner after a local send) while receivers
        are subscribed; queue new entries; start fetches."""
        while self._subs and not self.closed:
            self._nudge = anyio.Event()
            try:
                await self._scan()
            except TransportError as exc:
                self._count(errors=1, last_error=str(exc))
            self._dispatch()
            with anyio.move_on_after(self.config.poll_s):
                await self._nudge.wait()
        self._streams.clear()
        self._known.clear()

    async def _scan(self) -> None:
        stopped: set[int] = set()
        present: set[str] = set()
        new: list[tuple[str, int, str, str, int]] = []
        sizes: dict[str, int] = {}
        """Each new entry's size as the listing shows it."""
        for info in await self._list(MANIFEST):
            m = MANIFEST_RE.match(info.key)
            if m is None:
                continue
            attempt = int(m[1])
            if m[2] is None:
                stopped.add(attempt)
                continue
            present.add(info.key)
            if info.key not in self._known:
                new.append((info.key, attempt, m[2], m[3], int(m[4])))
                sizes[info.key] = info.size
        for attempt in stopped - self._remote_stopped:
            self.drop_fetches(attempt)
        self._remote_stopped = stopped
        if self._node is not None:
            self._forget_shared(self._known - present)
        self._known &= present  # entries cleaned up are forgotten
        live = {int(k[len(MANIFEST) : len(MANIFEST) + 20]) for k in present} | {
            a for a, _, _ in self._streams
        }
        if len(self._fetched_keys) > len(present):
            self._fetched_keys = {k for k in self._fetched_keys if k.attempt in live}
        new = [n for n in new if n[1] not in stopped and n[1] not in self._stopped]
        new.sort(key=lambda n: (n[1], n[2], n[3], n[4]))
        entries = await self._read_entries({n[0]: sizes[n[0]] for n in new})
        waiting: set[tuple[int, str, str]] = set()
        for key, attempt, owner_seg, writer, seq in new:
            if key not in entries or (attempt, owner_seg, writer) in waiting:
                # Not read whole, or an earlier entry of its stream was not: read again at
                # the next scan, so that each stream is still delivered in order.
                waiting.add((attempt, owner_seg, writer))
                continue
            self._known.add(key)
            entry = entries[key]
            owner = owner_name(owner_seg)
            if entry is None or owner is None:
                continue
            if entry.attempt != attempt or entry.owner != owner:
                self._count(bad_entries=1, last_error=f"manifest entry {key} names another key")
                continue
            recipients = [s for s in self._subs.values() if entry.to is None or s.name in entry.to]
            if not recipients:
                continue
            self._streams.setdefault((attempt, owner, writer), deque()).append(
                _Fetch(
                    key=PayloadKey(attempt=attempt, owner=owner, payload_id=entry.payload_id),
                    obj=payload_key(attempt, owner, writer, seq),
                    size=entry.size,
                    recipients=recipients,
                    addressed=entry.to is not None,
                )
            )

    def _forget_shared(self, entries: set[str]) -> None:
        """Drop the node's copies of payloads whose manifest entries were cleaned up (storage
        no longer holds them either; every process of the node does this, idempotently)."""
        assert self._node is not None
        for key in entries:
            m = MANIFEST_RE.match(key)
            owner = None if m is None or m[2] is None else owner_name(m[2])
            if m is not None and owner is not None:
                try:
                    self._node.discard(payload_key(int(m[1]), owner, m[3], int(m[4])))
                except OSError as exc:
                    self._count(errors=1, last_error=f"node cache: {exc}")

    async def _read_entries(self, keys: dict[str, int]) -> dict[str, ManifestEntry | None]:
        """GET manifest entries (``fetch_concurrency`` at a time; ``keys`` maps each to its
        size in the listing): a decoded entry, ``None`` for one that is gone or damaged; keys
        that could not be read whole are left out (their next scan reads them again).

        A read shorter or longer than the listing says (a cut response that still looked
        complete) is tried again like a short payload read, ``retries`` reads in all, each
        retry counted in ``retried``: an entry is decided on -- delivered or refused -- only
        from a complete read, so one bad read never hides its payload.
        """
        entries: dict[str, ManifestEntry | None] = {}
        limiter = anyio.CapacityLimiter(self.config.fetch_concurrency)
        tries = self.config.retries

        async def read(key: str) -> None:
            for i in range(tries):
                try:
                    async with limiter:
                        raw = await self._retry("reading a manifest entry",
                                                lambda: self.storage.backend.get(key))  # fmt: skip
                except TransportError as exc:
                    self._count(errors=1, last_error=str(exc))
                    return
                if raw is None or len(raw) == keys[key]:
                    entries[key] = None if raw is None else self._decode_entry(key, raw)
                    return
                what = f"manifest entry {key}: read {len(raw)} bytes, listed {keys[key]}"
                if i == tries - 1:
                    self._count(errors=1, last_error=f"{what}, {tries} reads in a row")
                    return
                self._count(retried=1, last_error=what)
                await anyio.sleep(self._backoff(i))

        async with anyio.create_task_group() as tg:
            for key in keys:
                tg.start_soon(read, key)
        return entries

    def _decode_entry(self, key: str, raw: bytes) -> ManifestEntry | None:
        """The entry stored as ``key`` once its seal (with a fleet secret) verified and it
        decoded; ``None``, counted as a bad entry, otherwise."""
        try:
            entry = decode_entry(raw, key, self.config.manifest_seal_key)
        except TransportError as exc:
            self._count(bad_entries=1, last_error=exc.message)
            return None
        if (
            entry.format != ENTRY_FORMAT
            or entry.payload_id < 0
            or not 0 <= entry.size <= self.config.max_payload_bytes
        ):
            self._count(bad_entries=1, last_error=f"a manifest entry is out of bounds: {entry}")
            return None
        return entry

    def drop_fetches(self, attempt: int) -> None:
        """Stop fetching ``attempt``: queued fetches end undelivered, running ones are
        dropped when they finish."""
        for (a, _, _), queue in self._streams.items():
            if a == attempt:
                for f in queue:
                    if f.state == "queued":
                        f.state = "done"
        self._deliver()

    def _dispatch(self) -> None:
        """Start fetches while GET slots are free, each stream in order, lowest payload ids
        first, only for receivers with room in their window."""
        if self.closed:
            return
        window = self.config.receiver_window
        while self._fetching < self.config.fetch_concurrency:
            best: _Fetch | None = None
            for queue in self._streams.values():
                head = next((f for f in queue if f.state == "queued"), None)
                if head is None or not all(s.room(window) for s in head.recipients):
                    continue
                if best is None or _rank(head) < _rank(best):
                    best = head
            if best is None:
                return
            best.state = "fetching"
            best.dispatched = True
            for s in best.recipients:
                s.reserved += 1
            self._fetching += 1
            self.spawn(self._fetch(best))

    async def _fetch(self, f: _Fetch) -> None:
        try:
            f.data = await self._fetch_verified(f)
        except TransportError as exc:
            self._count(errors=1, last_error=str(exc))
        finally:
            f.state = "done"
            self._fetching -= 1
            if not self.closed:
                self._deliver()
                self._dispatch()

    async def _fetch_verified(self, f: _Fetch) -> bytes | None:
        """GET the payload and check its length against the manifest entry; a short or
        missing read is tried again (``retries`` times in all)."""
        tries = self.config.retries
        for i in range(tries):
            data, downloaded = await self._retry(
                f"fetch of {f.key.owner}/{f.key.payload_id}",
                lambda: self._get_payload(f.obj),
                attempt=f.key.attempt,
            )
            if data is not None:
                if downloaded:
                    self._count_fetched(None, len(data))
                else:
                    self._count(shared=1)
                if len(data) == f.size:
                    return data
                if self._node is not None:
                    self._node.discard(f.obj)
            if i == tries - 1:
                if data is None:
                    self._count(missing=1, last_error=f"{f.obj} is listed but not stored")
                else:
                    self._count(damaged=1, last_error=f"{f.obj} holds {len(data)} bytes, "
                                                      f"its manifest entry {f.size}")  # fmt: skip
                return data
            if self._is_stopped(f.key.attempt):
                return None
            self._count(retried=1)
            await anyio.sleep(self._backoff(i))
        raise AssertionError("unreachable")

    async def _get_payload(self, obj: str) -> tuple[bytes | None, bool]:
        """A payload object and whether this process downloaded it (not a copy another
        process of the node downloaded, with ``node_cache``)."""
        if self._node is not None:
            try:
                return await self._node.get(
                    obj, lambda: self.storage.backend.get(obj, link=self.downlink)
                )
            except OSError as exc:  # the node's directory failed us: download alone
                self._count(errors=1, last_error=f"node cache {self.config.node_cache}: {exc}")
        return await self.storage.backend.get(obj, link=self.downlink), True

    def _is_stopped(self, attempt: int) -> bool:
        return attempt in self._stopped or attempt in self._remote_stopped

    def _count_fetched(self, key: PayloadKey | None, size: int) -> None:
        """Bytes fetched (V_cross); with ``key``, a payload handed over (V_payload counts
        each key once, in hand-over order)."""
        t = self.storage.fetched.traffic
        if key is None:
            traffic = replace(t, cross_bytes=t.cross_bytes + size)
        elif key in self._fetched_keys:
            return
        else:
            self._fetched_keys.add(key)
            traffic = replace(t, payloads=t.payloads + 1, payload_bytes=t.payload_bytes + size)
        self._count(traffic=traffic)

    def _deliver(self) -> None:
        """Hand finished fetches to their receivers, each stream in order."""
        for skey in list(self._streams):
            queue = self._streams[skey]
            while queue and queue[0].state == "done":
                self._hand_over(queue.popleft())
            if not queue:
                del self._streams[skey]

    def _hand_over(self, f: _Fetch) -> None:
        stopped = self._is_stopped(f.key.attempt)
        if f.data is not None:
            self._count_fetched(f.key, len(f.data))
        for s in f.recipients:
            if f.dispatched:
                s.reserved -= 1
            if f.data is None or stopped or s.closed:
                continue
            s.inbox.append(Delivery(key=f.key, data=f.data, addressed=f.addressed))
            s.untaken += 1
            s.wake.set()


def _rank(f: _Fetch) -> tuple[int, int, str]:
    """Fetch priority: the attempt's declared order (payload id, then owner)."""
    return (f.key.attempt, f.key.payload_id, f.key.owner)
