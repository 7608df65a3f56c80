"""The object-storage transport (paper §7.1 "Object storage", App. B "Transports", Fig. 7 left).

Owners upload each payload once, as one object under a per-attempt prefix, and list it in the
attempt's manifest; rollout nodes list the manifest and fetch every payload listed for their
receivers with a bounded number of concurrent GETs.  Storage decouples the two sides: a send
never waits for a receiver, and one stored copy serves every rollout node (each download
crosses the cluster boundary, so V_cross grows with the number of nodes).  A new store is one
subclass of :class:`ObjectBackend` (whole-object put, get, list, delete); the S3 and
directory backends live in :mod:`dcr.adapters.transport.s3` and
:mod:`dcr.adapters.transport.directory`.

Layout under the backend's root (attempt ids as 20 decimal digits, so they sort)::

    payload/<attempt>/<owner>/<writer>.<seq>       the payload bytes
    manifest/<attempt>/e/<owner>/<writer>.<seq>    its manifest entry: payload id, size, ``to``
    manifest/<attempt>/stopped                     the attempt's tombstone

``writer`` names the transport object (one per process) and ``seq`` numbers its sends of one
attempt and owner in the order ``send`` was called.  A writer posts its entries in that order
after their payloads are stored, so a listing holds a prefix of them and a node delivers each
owner's payloads in the order they were sent.  Every send is its own object: a re-send of the
same payload id (identical or not) is delivered again, and receivers deduplicate or fail the
attempt (App. B.1, reception checks).

**Stopping across processes** (App. B.2, stopping an attempt).  ``stop_and_wait`` and
``cleanup`` write the attempt's tombstone, then wait for this process's sends of it.  A sender
reads the tombstone before it uploads, before it posts the manifest entry and after; when it
finds one it deletes what it wrote and refuses the send (``retryable=False``, check
``stopped``).  On storage with read-after-write consistency (S3, a local or NFS directory)
every object of a stopped attempt is therefore either seen by ``cleanup``'s listing or deleted
by its sender.  Nodes never fetch an attempt that has a tombstone.  ``cleanup`` deletes the
attempt's objects and aborts its incomplete uploads; the tombstone stays ``tombstone_ttl_s``
to refuse late senders (a process that died between its upload and its check leaves an
object behind), then a later ``cleanup`` sweeps that attempt again and drops the tombstone.

**Arrival check** (App. B.1, flush).  ``send`` returns once the payload and its manifest entry
are stored, so the owners' declared counts are the manifest, and a receiver's arrival check
-- every declared payload arrived within ``arrival_grace_s`` -- is "every manifest entry
fetched and verified".  Each fetched payload's length is checked against its entry: a cut
connection is fetched again, while an object that stays shorter or longer than its entry is
handed over as stored, so the receiver's strict decoder fails the attempt at once instead of
waiting out the arrival grace.  A payload missing from storage is not delivered (the arrival
check fails the attempt).

Storage operations are retried with exponential backoff and full jitter when the backend
calls the error retryable (throttling such as S3's 503 SlowDown, 5xx, cut connections);
other errors, or the last retry's, surface as :class:`~dcr.errors.TransportError`.  Uploads
and fetches pass through the process's emulated link (:mod:`dcr.adapters.transport.link`,
``link_gbps``).  The transport runs background tasks on asyncio (like aiobotocore itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote

import anyio
import msgspec

from dcr.adapters.context import known_options
from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.nodeshare import NodeFetches
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = [
    "FetchStats",
    "ObjectBackend",
    "ObjectInfo",
    "ObjectStoreConfig",
    "ObjectStoreTransport",
    "decode_segment",
    "encode_segment",
    "fleet_settings",
    "manifest_key",
    "payload_key",
    "tombstone_key",
]

T = TypeVar("T")

MANIFEST = "manifest/"
PAYLOADS = "payload/"
ENTRY_FORMAT = 1
KEEP_ATTEMPTS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectInfo:
    """One stored object as a listing shows it."""

    key: str
    size: int
    modified: float
    """When it was last written (seconds since the epoch, the storage's clock)."""


class ObjectBackend(ABC):
    """Whole objects under one root: the primitives the object-storage transport builds on.

    Keys are ``/``-separated paths of segments from ``[A-Za-z0-9._%-]``.  A reader never sees
    part of an object: ``put`` makes it visible whole (an S3 PUT or completed multipart
    upload, a rename of a finished file).  Implementations convert their errors into
    :class:`~dcr.errors.TransportError` and say whether retrying may help.
    """

    @abstractmethod
    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        """Store ``data`` under ``key`` (replacing it), its bytes paced by ``link``."""

    @abstractmethod
    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` when there is no such object."""

    @abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Delete these objects; keys that do not exist are fine."""

    @abstractmethod
    async def abort_uploads(self, prefix: str) -> None:
        """Drop incomplete uploads under ``prefix`` (S3 multipart uploads, temporary files)."""

    def describe(self) -> str:
        """Where the objects live, for messages."""
        return type(self).__name__

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def encode_segment(name: str) -> str:
    """``name`` as one key segment: every character outside ``[A-Za-z0-9_-]`` is
    percent-encoded (``.`` too, so no segment is ``.`` or ``..``)."""
    if not name:
        raise ConfigError("an empty name cannot be a key segment")
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)


def decode_segment(segment: str) -> str:
    """The name :func:`encode_segment` encoded."""
    return unquote(segment, errors="strict")


def _attempt(attempt: int) -> str:
    if not 0 <= attempt < 10**20:
        raise ConfigError(f"attempt id {attempt} outside [0, 10**20)")
    return f"{attempt:020d}"


def payload_key(attempt: int, owner: str, writer: str, seq: int) -> str:
    """Where a payload's bytes live."""
    return f"{PAYLOADS}{_attempt(attempt)}/{encode_segment(owner)}/{writer}.{seq:010d}"


def manifest_key(attempt: int, owner: str, writer: str, seq: int) -> str:
    """Where the manifest entry of that payload lives."""
    return f"{MANIFEST}{_attempt(attempt)}/e/{encode_segment(owner)}/{writer}.{seq:010d}"


def tombstone_key(attempt: int) -> str:
    """The object whose presence says ``attempt`` is stopped."""
    return f"{MANIFEST}{_attempt(attempt)}/stopped"


_MANIFEST_RE = re.compile(
    r"^manifest/(\d{20})/(?:stopped|e/([A-Za-z0-9_%-]+)/([0-9a-f]{16})\.(\d{10}))$"
)


class _Entry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A manifest entry (JSON).  The payload object's key follows from the entry's own key,
    so an entry cannot point a node at any other object."""

    format: int
    attempt: int
    owner: str
    payload_id: int
    size: int
    to: list[str] | None


_ENTRY_DECODER = msgspec.json.Decoder(_Entry, strict=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectStoreConfig:
    """Settings of the object-storage transport; every field has a default.

    ``arrival_grace_s`` is the transport's promise to receivers (the arrival check at flush):
    how long after its owner's send returned a payload may take to reach them -- one
    ``poll_s`` plus the fetch itself, and behind a slow link, the payloads queued before it.
    Raise it when payloads are large for the link.
    """

    poll_s: float = 0.1
    """How often a node lists the manifests while it has subscribed receivers."""
    fetch_concurrency: int = 4
    """GETs a node runs at once."""
    receiver_window: int = 8
    """Deliveries a receiver holds without taking them before its node stops fetching for it
    (bounds a node's memory: at most ``fetch_concurrency + window`` payloads per receiver)."""
    arrival_grace_s: float = 30.0
    link_gbps: float | None = None
    """Emulated per-process link rate, each direction (``None``: unlimited)."""
    retries: int = 6
    """Tries of one storage operation before its error surfaces."""
    backoff_s: float = 0.05
    """First backoff between tries; it doubles each try (full jitter)."""
    backoff_max_s: float = 2.0
    max_payload_bytes: int = 1 << 34
    """Largest payload sent or fetched (a manifest entry above it is refused)."""
    tombstone_ttl_s: float = 3600.0
    """How long a stopped attempt's tombstone refuses late senders."""
    cleanup_timeout_s: float = 60.0
    """Bound on a cleanup (and on writing a tombstone), which finishes even when its caller
    is cancelled."""
    node_cache: str | None = None
    """A directory the receiver processes of one rollout node share (local disk or tmpfs):
    each payload is then downloaded once per node, not once per process
    (:mod:`~dcr.adapters.transport.nodeshare`).  ``None``: every process downloads."""

    def __post_init__(self) -> None:
        checks = {
            "poll_s": self.poll_s > 0,
            "fetch_concurrency": self.fetch_concurrency >= 1,
            "receiver_window": self.receiver_window >= 1,
            "arrival_grace_s": self.arrival_grace_s >= 0,
            "link_gbps": self.link_gbps is None or self.link_gbps >= 0,
            "retries": self.retries >= 1,
            "backoff_s": 0 <= self.backoff_s <= self.backoff_max_s,
            "max_payload_bytes": self.max_payload_bytes >= 1,
            "tombstone_ttl_s": self.tombstone_ttl_s >= 0,
            "cleanup_timeout_s": self.cleanup_timeout_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid object-store transport settings: {', '.join(bad)}")


def fleet_settings(
    options: Mapping[str, Any], context: AdapterContext, *, own: Iterable[str] = ()
) -> dict[str, Any]:
    """The keys of a fleet file's object-store transport section, for one process.

    ``own`` are the backend's keys (a bucket, a path); the others are
    :class:`ObjectStoreConfig` fields, and any other key raises
    :class:`~dcr.errors.ConfigError`.  ``node_cache`` becomes this process's node directory:
    in a process hosting receivers of rollout node ``N``, ``<node_cache>/N`` (relative to the
    fleet file), or ``<run_dir>/fetches/N`` without one where ``N`` hosts several receivers,
    so their processes download each payload once; elsewhere (owners, the coordinator)
    nothing, since only receivers fetch.
    """
    known = {*own, *(f.name for f in fields(ObjectStoreConfig))}
    opts = known_options(options, known, context.section)
    shared = opts.pop("node_cache", None)
    if context.node is not None and (shared is not None or context.node_receivers > 1):
        base = context.path(shared) if shared is not None else context.run_dir / "fetches"
        opts["node_cache"] = str(base / context.node)
    return opts


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchStats:
    """What a node fetched: the rollout side's view of the boundary (paper §8.7)."""

    traffic: TransportStats = field(default_factory=TransportStats)
    """V_cross (``cross_bytes``: every byte fetched) and V_payload (each payload key once)."""
    damaged: int = 0
    """Payloads whose stored length stayed different from their manifest entry (handed over
    as stored: the receiver's checks fail the attempt)."""
    missing: int = 0
    """Listed payloads storage no longer held (not delivered)."""
    bad_entries: int = 0
    """Manifest entries that did not decode or did not match their key (ignored)."""
    errors: int = 0
    """Listings and fetches that failed after every retry."""
    retried: int = 0
    """Storage operations tried again after a retryable error (sends included)."""
    shared: int = 0
    """Payloads read from the node's shared copies (``node_cache``) instead of storage."""
    last_error: str = ""


class _Turns:
    """The order in which one writer posts the manifest entries of one (attempt, owner)."""

    def __init__(self) -> None:
        self.next = 0
        self._posted = 0
        self._done: set[int] = set()
        self._moved = anyio.Event()

    def take(self) -> int:
        seq = self.next
        self.next += 1
        return seq

    async def wait(self, seq: int) -> None:
        while self._posted < seq:
            await self._moved.wait()

    def finish(self, seq: int) -> None:
        self._done.add(seq)
        while self._posted in self._done:
            self._done.discard(self._posted)
            self._posted += 1
        self._moved.set()
        self._moved = anyio.Event()


@dataclass(eq=False)
class _Sub:
    name: str
    inbox: deque[Delivery] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)
    untaken: int = 0
    reserved: int = 0
    closed: bool = False

    def room(self, window: int) -> bool:
        return self.closed or self.untaken + self.reserved < window


class _Deliveries(AsyncIterator[Delivery]):
    def __init__(self, sub: _Sub) -> None:
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


@dataclass(eq=False)
class _Fetch:
    """One manifest entry on its way to a node's receivers."""

    key: PayloadKey
    obj: str
    size: int
    recipients: list[_Sub]
    state: str = "queued"
    """``queued`` -> ``fetching`` -> ``done`` (or ``queued`` -> ``done``: dropped)."""
    dispatched: bool = False
    """A GET started for it: a window slot of each recipient is reserved until hand-over."""
    data: bytes | None = None


class ObjectStoreTransport(Transport):
    """The object-storage transport over ``backend`` (which it owns and closes).

    One object per process: owners send through it, the coordinator stops and cleans up
    through it, and the receivers of the process subscribe to it -- the process is one
    rollout node, whose fetches its receivers share (each payload fetched once, handed to
    every subscribed receiver it is meant for).  :meth:`stats` counts uploads (what this
    object sent), :meth:`fetch_stats` what it fetched.
    """

    def __init__(self, backend: ObjectBackend, config: ObjectStoreConfig | None = None) -> None:
        self.backend = backend
        self.config = config or ObjectStoreConfig()
        self.arrival_grace_s = self.config.arrival_grace_s
        self.receiver_window = self.config.receiver_window
        self.writer = uuid.uuid4().hex[:16]
        """This object's name in object keys."""
        self.uplink = LinkLimit(self.config.link_gbps)
        self.downlink = LinkLimit(self.config.link_gbps)
        self._rng = random.Random()
        self._closed = False
        # sending side
        self._stopped: set[int] = set()
        self._turns: dict[tuple[int, str], _Turns] = {}
        self._inflight: dict[int, int] = {}
        self._idle = anyio.Event()
        self._sent_keys: set[PayloadKey] = set()
        self._sent = TransportStats()
        # receiving side
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
        self._fetched = FetchStats()
        self._node = NodeFetches(self.config.node_cache) if self.config.node_cache else None

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(
                "the object-store transport is closed", retryable=False, check="closed"
            )

    def _count(self, **changes: Any) -> None:
        f = self._fetched
        self._fetched = FetchStats(
            traffic=changes.get("traffic", f.traffic),
            damaged=f.damaged + changes.get("damaged", 0),
            missing=f.missing + changes.get("missing", 0),
            bad_entries=f.bad_entries + changes.get("bad_entries", 0),
            errors=f.errors + changes.get("errors", 0),
            retried=f.retried + changes.get("retried", 0),
            shared=f.shared + changes.get("shared", 0),
            last_error=changes.get("last_error", f.last_error),
        )

    def _backoff(self, i: int) -> float:
        c = self.config
        return self._rng.uniform(0, min(c.backoff_max_s, c.backoff_s * 2**i))

    async def _retry(
        self, what: str, op: Callable[[], Awaitable[T]], *, attempt: int | None = None
    ) -> T:
        """Run a storage operation, retrying retryable errors with backoff (full jitter)."""
        tries = self.config.retries
        for i in range(tries):
            try:
                return await op()
            except TransportError as exc:
                if not exc.retryable or i == tries - 1:
                    raise TransportError(
                        f"{what} on {self.backend.describe()} failed after {i + 1} tries: "
                        f"{exc.message}",
                        retryable=exc.retryable,
                        attempt=attempt if attempt is not None else exc.attempt,
                        check=exc.check,
                    ) from exc
                self._count(retried=1)
                await anyio.sleep(self._backoff(i))
        raise AssertionError("unreachable")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
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

    # -- Transport: sending -----------------------------------------------------------------

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        """Upload the payload, then post its manifest entry (paper App. C: ``put`` +
        ``post_manifest``); returns once both are stored."""
        self._check_open()
        attempt = key.attempt
        if attempt in self._stopped:
            raise _stopped(attempt)
        if len(data) > self.config.max_payload_bytes:
            raise TransportError(
                f"payload of {len(data)} bytes above max_payload_bytes "
                f"{self.config.max_payload_bytes}",
                retryable=False,
                attempt=attempt,
                check="oversized",
            )
        if to is not None and not to:
            return  # addressed to nobody
        if (attempt, key.owner) not in self._turns:
            self._forget_old_sends()
        turns = self._turns.setdefault((attempt, key.owner), _Turns())
        seq = turns.take()
        obj = payload_key(attempt, key.owner, self.writer, seq)
        entry = manifest_key(attempt, key.owner, self.writer, seq)
        body = msgspec.json.encode(
            _Entry(
                format=ENTRY_FORMAT,
                attempt=attempt,
                owner=key.owner,
                payload_id=key.payload_id,
                size=len(data),
                to=None if to is None else sorted(to),
            )
        )
        what = f"{key.owner}/{key.payload_id}"
        self._inflight[attempt] = self._inflight.get(attempt, 0) + 1
        written: list[str] = []
        try:
            await self._guard(attempt)
            written.append(obj)
            await self._retry(f"upload of {what}",
                              lambda: self.backend.put(obj, data, link=self.uplink),
                              attempt=attempt)  # fmt: skip
            await turns.wait(seq)
            await self._guard(attempt)
            written.append(entry)
            await self._retry(f"manifest entry of {what}",
                              lambda: self.backend.put(entry, body), attempt=attempt)  # fmt: skip
            await self._guard(attempt)
        except BaseException:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(10),
                contextlib.suppress(TransportError),
            ):
                await self.backend.delete(written)
            raise
        finally:
            turns.finish(seq)
            self._inflight[attempt] -= 1
            if not self._inflight[attempt]:
                del self._inflight[attempt]
                self._idle.set()
                self._idle = anyio.Event()
        s = self._sent
        new = key not in self._sent_keys
        self._sent_keys.add(key)
        self._sent = TransportStats(
            payloads=s.payloads + new,
            payload_bytes=s.payload_bytes + (len(data) if new else 0),
            cross_bytes=s.cross_bytes + len(data),
        )
        self._nudge.set()

    def _forget_old_sends(self) -> None:
        """Bound what an owner process remembers: the posting order and V_payload keys of
        the most recent ``KEEP_ATTEMPTS`` attempts it sent for (an owner never cleans up;
        the coordinator does, in its own process)."""
        attempts = sorted({a for a, _ in self._turns} - set(self._inflight))
        if len(attempts) < KEEP_ATTEMPTS:
            return
        old = set(attempts[: len(attempts) - KEEP_ATTEMPTS + 1])
        self._turns = {k: t for k, t in self._turns.items() if k[0] not in old}
        self._sent_keys = {k for k in self._sent_keys if k.attempt not in old}

    async def _guard(self, attempt: int) -> None:
        """Refuse the send when the attempt was stopped here or anywhere (its tombstone)."""
        if attempt in self._stopped:
            raise _stopped(attempt)
        found = await self._retry("reading the tombstone",
                                  lambda: self.backend.get(tombstone_key(attempt)),
                                  attempt=attempt)  # fmt: skip
        if found is not None:
            self._stopped.add(attempt)
            raise _stopped(attempt)

    async def stop_and_wait(self, attempt: int) -> None:
        """Write the attempt's tombstone (no sender uploads or posts for it any more, no node
        fetches it) and wait for this process's sends of it."""
        self._check_open()
        self._stop_here(attempt)
        with self._finishing("writing the tombstone", attempt):
            await self._tombstone(attempt)
        await self._drained(attempt)

    async def cleanup(self, attempt: int) -> None:
        """Stop the attempt, delete its objects, abort its incomplete uploads; then sweep
        attempts whose tombstones outlived ``tombstone_ttl_s``.

        Once begun, a cleanup runs to its end even when its caller is cancelled (a
        coordinator ends its transition right after asking for it), bounded by
        ``cleanup_timeout_s``: a cleanup cut short would leave objects behind.
        """
        self._check_open()
        self._stop_here(attempt)
        with self._finishing("cleanup", attempt):
            await self._tombstone(attempt)
            await self._drained(attempt)
            await self._sweep(attempt)
            for k in [k for k in self._turns if k[0] == attempt]:
                del self._turns[k]
            self._sent_keys = {k for k in self._sent_keys if k.attempt != attempt}
            await self._collect_tombstones()

    @contextlib.contextmanager
    def _finishing(self, what: str, attempt: int) -> Iterator[None]:
        """Shielded from cancellation, bounded by ``cleanup_timeout_s``."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self.config.cleanup_timeout_s
            yield
        if scope.cancelled_caught:
            raise TransportError(
                f"{what} on {self.backend.describe()} took over {self.config.cleanup_timeout_s} s",
                retryable=True,
                attempt=attempt,
                check="timeout",
            )

    def _stop_here(self, attempt: int) -> None:
        self._stopped.add(attempt)
        self._drop_fetches(attempt)

    async def _tombstone(self, attempt: int) -> None:
        body = msgspec.json.encode({"attempt": attempt, "writer": self.writer, "t": time.time()})
        await self._retry("writing the tombstone",
                          lambda: self.backend.put(tombstone_key(attempt), body),
                          attempt=attempt)  # fmt: skip

    async def _drained(self, attempt: int) -> None:
        while self._inflight.get(attempt):
            await self._idle.wait()

    async def _sweep(self, attempt: int, *, tombstone: bool = False) -> None:
        """Delete the attempt's payloads and manifest entries (and its tombstone)."""
        a = _attempt(attempt)
        keep = None if tombstone else tombstone_key(attempt)
        found: list[str] = []
        for prefix in (f"{PAYLOADS}{a}/", f"{MANIFEST}{a}/"):
            listed = await self._list(prefix, attempt)
            found += [o.key for o in listed if o.key != keep]
        if found:
            await self._retry("deleting the attempt's objects",
                              lambda: self.backend.delete(found), attempt=attempt)  # fmt: skip
        await self._retry("aborting the attempt's uploads",
                          lambda: self.backend.abort_uploads(f"{PAYLOADS}{a}/"),
                          attempt=attempt)  # fmt: skip

    async def _list(self, prefix: str, attempt: int | None = None) -> list[ObjectInfo]:
        return await self._retry(f"listing {prefix}", lambda: self.backend.list(prefix),
                                 attempt=attempt)  # fmt: skip

    async def _collect_tombstones(self) -> None:
        horizon = time.time() - self.config.tombstone_ttl_s
        for info in await self._list(MANIFEST):
            m = _MANIFEST_RE.match(info.key)
            if m is not None and m[2] is None and info.modified < horizon:
                await self._sweep(int(m[1]), tombstone=True)

    async def purge(self) -> None:
        """Delete every payload, manifest entry and tombstone under the store's root and
        abort incomplete uploads: a fresh start for a fleet whose attempt ids begin again
        (never while a fleet uses the store)."""
        found = [o.key for p in (PAYLOADS, MANIFEST) for o in await self._list(p)]
        if found:
            await self._retry("purging the store", lambda: self.backend.delete(found))
        await self._retry("aborting uploads", lambda: self.backend.abort_uploads(PAYLOADS))

    # -- Transport: receiving ---------------------------------------------------------------

    def subscribe(self, receiver: str) -> AsyncIterator[Delivery]:
        self._check_open()
        if receiver in self._subs:
            raise TransportError(
                f"{receiver!r} is already subscribed", retryable=False, check="subscribe"
            )
        sub = self._subs[receiver] = _Sub(receiver)
        if self._poller is None or self._poller.done():
            self._poller = self._spawn(self._poll())
        self._nudge.set()
        return _Deliveries(sub)

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

    def stats(self) -> TransportStats:
        """Payloads this object uploaded (every send in ``cross_bytes``, each key once in
        ``payload_bytes``)."""
        return self._sent

    def fetch_stats(self) -> FetchStats:
        """What this node fetched for its receivers."""
        return self._fetched

    async def _poll(self) -> None:
        """List the manifests every ``poll_s`` (sooner after a local send) while receivers
        are subscribed; queue new entries; start fetches."""
        while self._subs and not self._closed:
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
        for info in await self._list(MANIFEST):
            m = _MANIFEST_RE.match(info.key)
            if m is None:
                continue
            attempt = int(m[1])
            if m[2] is None:
                stopped.add(attempt)
                continue
            present.add(info.key)
            if info.key not in self._known:
                new.append((info.key, attempt, m[2], m[3], int(m[4])))
        for attempt in stopped - self._remote_stopped:
            self._drop_fetches(attempt)
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
        entries = await self._read_entries([n[0] for n in new])
        for key, attempt, owner_seg, writer, seq in new:
            if key not in entries:
                continue  # read again at the next scan
            self._known.add(key)
            entry = entries[key]
            owner = _owner(owner_seg)
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
                )
            )

    def _forget_shared(self, entries: set[str]) -> None:
        """Drop the node's copies of payloads whose manifest entries were cleaned up (storage
        no longer holds them either; every process of the node does this, idempotently)."""
        assert self._node is not None
        for key in entries:
            m = _MANIFEST_RE.match(key)
            owner = None if m is None or m[2] is None else _owner(m[2])
            if m is not None and owner is not None:
                try:
                    self._node.discard(payload_key(int(m[1]), owner, m[3], int(m[4])))
                except OSError as exc:
                    self._count(errors=1, last_error=f"node cache: {exc}")

    async def _read_entries(self, keys: list[str]) -> dict[str, _Entry | None]:
        """GET manifest entries (``fetch_concurrency`` at a time): a decoded entry, ``None``
        for one that is gone or damaged; keys that could not be read are left out."""
        entries: dict[str, _Entry | None] = {}
        limiter = anyio.CapacityLimiter(self.config.fetch_concurrency)

        async def read(key: str) -> None:
            try:
                async with limiter:
                    raw = await self._retry("reading a manifest entry",
                                            lambda: self.backend.get(key))  # fmt: skip
            except TransportError as exc:
                self._count(errors=1, last_error=str(exc))
                return
            entries[key] = None if raw is None else self._decode_entry(raw)

        async with anyio.create_task_group() as tg:
            for key in keys:
                tg.start_soon(read, key)
        return entries

    def _decode_entry(self, raw: bytes) -> _Entry | None:
        try:
            entry = _ENTRY_DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            self._count(bad_entries=1, last_error=f"a manifest entry does not decode: {exc}")
            return None
        if (
            entry.format != ENTRY_FORMAT
            or entry.payload_id < 0
            or not 0 <= entry.size <= self.config.max_payload_bytes
        ):
            self._count(bad_entries=1, last_error=f"a manifest entry is out of bounds: {entry}")
            return None
        return entry

    def _drop_fetches(self, attempt: int) -> None:
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
        if self._closed:
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
            self._spawn(self._fetch(best))

    async def _fetch(self, f: _Fetch) -> None:
        try:
            f.data = await self._fetch_verified(f)
        except TransportError as exc:
            self._count(errors=1, last_error=str(exc))
        finally:
            f.state = "done"
            self._fetching -= 1
            if not self._closed:
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
                return await self._node.get(obj, lambda: self.backend.get(obj, link=self.downlink))
            except OSError as exc:  # the node's directory failed us: download alone
                self._count(errors=1, last_error=f"node cache {self.config.node_cache}: {exc}")
        return await self.backend.get(obj, link=self.downlink), True

    def _is_stopped(self, attempt: int) -> bool:
        return attempt in self._stopped or attempt in self._remote_stopped

    def _count_fetched(self, key: PayloadKey | None, size: int) -> None:
        """Bytes fetched (V_cross); with ``key``, a payload handed over (V_payload counts
        each key once, in hand-over order)."""
        t = self._fetched.traffic
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
            s.inbox.append(Delivery(key=f.key, data=f.data))
            s.untaken += 1
            s.wake.set()

    async def aclose(self) -> None:
        """Cancel polling and fetches, end every subscription, close the backend."""
        if self._closed:
            return
        self._closed = True
        for sub in self._subs.values():
            sub.closed = True
            sub.wake.set()
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.backend.aclose()


def _rank(f: _Fetch) -> tuple[int, int, str]:
    """Fetch priority: the attempt's declared order (payload id, then owner)."""
    return (f.key.attempt, f.key.payload_id, f.key.owner)


def _owner(segment: str) -> str | None:
    try:
        return decode_segment(segment)
    except UnicodeDecodeError:
        return None


def _stopped(attempt: int) -> TransportError:
    return TransportError(
        "the attempt was stopped; payload refused",
        retryable=False,
        attempt=attempt,
        check="stopped",
    )
