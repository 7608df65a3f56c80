"""The S3 commit store: the commit record as one object, changed by conditional writes.

The whole :class:`~dcr.adapters.commit.base.CommitState` is one JSON object.  A transaction
reads it with its ETag, computes the new state and writes it back with ``If-Match: <etag>``
(``If-None-Match: *`` when the object does not exist yet), so two writers can never both
succeed: the loser's condition fails and it reads again (optimistic concurrency, paper App.
B.2's compare-and-set).  An ETag is a hash of the content, so the body carries the state's
``revision`` and a fresh random ``nonce``: two writes of equal states still differ, and an old
writer holding a stale ETag cannot win twice.  When a write's answer is lost (a cut
connection, a 5xx), the nonce also tells whether it landed: the store reads the object back
and finds its own nonce or not.  Stores differ in how a failed condition is answered -- 412
Precondition Failed, 409 ConditionalRequestConflict, or 404 NoSuchKey for ``If-Match`` on a
missing object (AWS, moto; SeaweedFS answers 412) -- and all of them count as a lost race.

The compare-and-set is only as atomic as the store's conditional writes.  SeaweedFS (the
``weed mini`` server of the tests) checks ``If-Match`` and writes without a lock: several
conditional PUTs with the same ETag, sent at once, can succeed together (measured: in 129
of 300 rounds of three such PUTs, two succeeded).  One store object therefore runs its
transactions one at a time -- a coordinator's lease renewal and its commit never race each
other inside one process.  Coordinators in several processes (standbys) rely on the store's
conditional writes being atomic, as AWS S3's are; with SeaweedFS, prefer the SQLite store
(one host) for the commit record.

**The record never rewinds.**  A missing record object stands for a store that was never
written -- unless the *marker* ``<key>.written`` beside it exists: the store writes it right
after its first write of the record (and again whenever the record or the coordinator epoch
changes, so it stays as young as the last commit and tells the last version committed).  A
missing record with a marker is a :func:`~dcr.adapters.commit.base.record_missing` error, on
reads and writes alike: the record was deleted or expired, and only :meth:`S3CommitStore.reset`
(``dcr commit-store reset``) brings the store back to the empty state.  Keep the prefix out of
lifecycle expiry rules: both objects expiring would still read as a store never written.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.lowlevel
import msgspec

from dcr.adapters.commit.base import (
    INITIAL_RECORD,
    CommitState,
    CommitStore,
    Transaction,
    record_missing,
)
from dcr.adapters.context import construct, known_options
from dcr.adapters.transport.s3 import S3Backend, S3Options
from dcr.errors import CommitStoreError, ConfigError, TransportError
from dcr.protocol.types import CommitRecord

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["S3CommitStore"]

FORMAT = 1
MARKER_SUFFIX = ".written"
"""The marker object beside the record: ``<key>.written``."""


class _Body(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The stored object (JSON)."""

    format: int
    version: int
    candidate: str
    epoch: int
    attempt: int | None
    deadline: float | None
    obsolete: list[int]
    info: str
    address: str
    lease: float | None
    revision: int
    nonce: str


_DECODER = msgspec.json.Decoder(_Body, strict=True)


class _Marker(msgspec.Struct, frozen=True):
    """The marker object (JSON): its presence says the record was written; its fields are
    the last record and epoch one writer saw (for messages only)."""

    format: int
    version: int
    candidate: str
    epoch: int
    written: float


_MARKER_DECODER = msgspec.json.Decoder(_Marker)


def _encode(s: CommitState, nonce: str) -> bytes:
    return msgspec.json.encode(
        _Body(
            format=FORMAT,
            version=s.record.version,
            candidate=s.record.candidate,
            epoch=s.epoch,
            attempt=s.attempt,
            deadline=s.deadline,
            obsolete=sorted(s.obsolete),
            info=s.info,
            address=s.address,
            lease=s.lease,
            revision=s.revision,
            nonce=nonce,
        )
    )


class S3CommitStore(CommitStore):
    """The commit record at ``s3://bucket/prefix/key`` (registered as ``s3``).

    A missing object stands for a store that was never written: ``record`` (default version
    0); once written, a missing object is an error (see the module's docstring).  Credentials
    and region come from the standard AWS chain; ``endpoint_url`` points at another S3.
    ``max_races`` bounds how often one operation re-reads after losing a race before it gives
    up with a retryable :class:`~dcr.errors.CommitStoreError`.
    """

    def __init__(
        self,
        *,
        bucket: str,
        key: str = "commit.json",
        prefix: str = "dcr",
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        addressing_style: str = "auto",
        record: CommitRecord = INITIAL_RECORD,
        max_races: int = 64,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(clock=clock, poll_s=poll_s)
        if not key or key.startswith("/") or max_races < 1:
            raise ConfigError(f"S3 commit store: invalid key {key!r} or max_races {max_races}")
        self.key = key
        self.max_races = max_races
        self._initial = record
        self.marker_key = key + MARKER_SUFFIX
        self._marked: tuple[CommitRecord, int] | None = None
        """The record and epoch this object last wrote into the marker (``None``: not yet)."""
        self._backend = S3Backend(
            S3Options(
                bucket=bucket,
                prefix=prefix,
                endpoint_url=endpoint_url,
                region=region,
                profile=profile,
                addressing_style=addressing_style,
            )
        )
        self._rng = random.Random()
        self._lock: anyio.Lock | None = None
        self._lock_loop: object = None

    OPTIONS = ("bucket", "key", "prefix", "endpoint_url", "region", "profile",
               "addressing_style", "max_races", "poll_s")  # fmt: skip
    """Keys of a fleet file's ``[commit_store]`` section for this store."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The record object every process of the fleet opens (``bucket`` is required)."""
        opts = known_options(options, cls.OPTIONS, context.section)
        return construct(cls, opts, context.section, required=("bucket",))

    def _serial(self) -> anyio.Lock:
        """The lock that runs this store's transactions one at a time (one per event loop:
        a store may serve several ``anyio.run`` calls in turn)."""
        loop = anyio.lowlevel.current_token()
        if self._lock is None or self._lock_loop != loop:
            self._lock, self._lock_loop = anyio.Lock(), loop
        return self._lock

    def describe(self) -> str:
        return f"{self._backend.describe()}/{self.key}"

    async def _read(self) -> tuple[CommitState, str | None, str]:
        """The stored state, its ETag (``None``: no object yet) and its nonce."""
        try:
            found = await self._backend.read_versioned(self.key)
        except TransportError as exc:
            raise CommitStoreError(f"reading {self.describe()}: {exc.message}",
                                   retryable=exc.retryable, check="read") from exc  # fmt: skip
        if found is None:
            await self._check_unwritten()
            return CommitState(record=self._initial), None, ""
        raw, etag = found
        try:
            body = _DECODER.decode(raw)
        except msgspec.DecodeError as exc:
            raise CommitStoreError(f"{self.describe()} is not a commit record: {exc}",
                                   retryable=False, check="record") from exc  # fmt: skip
        if body.format != FORMAT:
            raise CommitStoreError(f"{self.describe()} has format {body.format}, not {FORMAT}",
                                   retryable=False, check="record")  # fmt: skip
        state = CommitState(
            record=CommitRecord(version=body.version, candidate=body.candidate),
            epoch=body.epoch,
            attempt=body.attempt,
            deadline=body.deadline,
            obsolete=frozenset(body.obsolete),
            info=body.info,
            address=body.address,
            lease=body.lease,
            revision=body.revision,
        )
        return state, etag, body.nonce

    async def _check_unwritten(self) -> None:
        """The record object is missing: raise :func:`record_missing` if the marker says it
        was written."""
        try:
            found = await self._backend.get(self.marker_key)
        except TransportError as exc:
            raise CommitStoreError(f"reading {self._where(self.marker_key)}: {exc.message}",
                                   retryable=exc.retryable, check="read") from exc  # fmt: skip
        if found is None:
            return
        self._marked = None
        try:
            m = _MARKER_DECODER.decode(found)
            last = f"version {m.version} ({m.candidate}) at coordinator epoch {m.epoch}"
        except msgspec.DecodeError:
            last = "a record"
        raise record_missing(
            self.describe(), f"its marker {self._where(self.marker_key)} says it held {last}"
        )

    async def _mark(self, state: CommitState) -> None:
        """Write the marker after a write of the record: the first one of this object, and
        each that changed the record or the epoch."""
        if self._marked == (state.record, state.epoch):
            return
        body = msgspec.json.encode(
            _Marker(
                format=FORMAT,
                version=state.record.version,
                candidate=state.record.candidate,
                epoch=state.epoch,
                written=time.time(),
            )
        )
        try:
            await self._backend.put(self.marker_key, body)
        except TransportError as exc:
            raise CommitStoreError(
                f"{self.describe()} was written, but its marker {self._where(self.marker_key)} "
                f"was not: {exc.message} (the next write tries again)",
                retryable=exc.retryable,
                check="write",
            ) from exc
        self._marked = (state.record, state.epoch)

    def _where(self, key: str) -> str:
        return f"{self._backend.describe()}/{key}"

    async def _transact(self, fn: Transaction) -> CommitState:
        async with self._serial():
            return await self._transact_alone(fn)

    async def _transact_alone(self, fn: Transaction) -> CommitState:
        for race in range(self.max_races):
            state, etag, _ = await self._read()
            new = fn(state)
            if new is None:
                return state
            nonce = uuid.uuid4().hex
            try:
                written = await self._backend.put_if(self.key, _encode(new, nonce), etag=etag)
            except TransportError as exc:
                if not await self._landed(nonce):
                    raise CommitStoreError(
                        f"writing {self.describe()}: {exc.message}",
                        retryable=exc.retryable,
                        check="write",
                    ) from exc
                written = "landed"
            if written is not None:
                await self._mark(new)
                return new
            await anyio.sleep(self._rng.uniform(0, min(0.5, 0.01 * 2**race)))
        raise CommitStoreError(
            f"{self.describe()} changed under {self.max_races} tries in a row",
            retryable=True,
            check="contended",
        )

    async def _landed(self, nonce: str) -> bool:
        """Whether the object now holds the write tagged ``nonce`` (its answer was lost)."""
        try:
            return (await self._read())[2] == nonce
        except CommitStoreError:
            return False

    async def reset(self, *, dry_run: bool = False) -> list[str]:
        """Delete the record object, then its marker: the store reads as never written
        (``record``, epoch 0).  An operator's command (``dcr commit-store reset``), never
        while a fleet uses the record.  Returns the objects it deleted (``dry_run``: would
        delete) as ``s3://`` addresses."""
        async with self._serial():
            try:
                stored = {info.key for info in await self._backend.list(self.key)}
                held = [k for k in (self.key, self.marker_key) if k in stored]
                if not dry_run:
                    for key in (self.key, self.marker_key):  # the record first: a reset cut
                        await self._backend.delete([key])  # short still reads as missing
            except TransportError as exc:
                raise CommitStoreError(f"resetting {self.describe()}: {exc.message}",
                                       retryable=exc.retryable, check="write") from exc  # fmt: skip
            if not dry_run:
                self._marked = None
        return [self._where(k) for k in held]

    async def close(self) -> None:
        await self._backend.aclose()

    def __repr__(self) -> str:
        return f"S3CommitStore({self.describe()})"
