"""Intervals an owner process reports for the refit benchmark (paper §8.7, App. C).

The benchmark's lower bounds are unions of intervals on one owner (construction: comparison,
projection, packing, encoding and zstd of each bucket) or on one sending endpoint (transport:
from a payload's submission until the transport accepted it).  These wrappers time exactly
those calls of the owner engine and append them to the process's event file, on the wall
clock every process of a host shares:

* ``built`` -- one bucket: its records built (``next`` of the owner's bucket stream) and its
  payload encoded, one worker thread, back to back; a first bucket built ahead of the prepare
  reports two, its build and its encoding.  The second also says how the bucket's tensors
  travel: ``relative`` (how many tensors have relative entries, XOR or ULP), ``overwrite``
  (how many have overwrite entries) and, in mixed mode, ``overwrite_names`` (the first of
  them by name: what the prepare's refused set, or residual conversion, sent as overwrites);
* ``sent`` -- carries ``start``, the moment the payload was handed to the transport (the
  owner engine reports the end);
* ``baseline`` -- the owner's baseline update after the commit.

A receiver on object storage reports ``fetched`` for each payload its node fetched (the
GET's interval and bytes), the rollout side's transport intervals and V_cross.  A receiver
on the relay tree reports ``drops`` whenever the frames its subscription dropped change
(per reason: ``replayed``, ``unsent``, ``socket``, ...), and ``untaken`` once deliveries it
holds have stayed untaken and unchanged in number for ``STALL_S``: why deliveries stalled,
if they do.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Container, Iterator, Sequence

import anyio

from dcr.adapters.transport.base import Transport, TransportWrapper
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore import (
    ObjectBackend,
    ObjectInfo,
    ObjectStoreTransport,
)
from dcr.adapters.transport.objstore.layout import PAYLOADS
from dcr.adapters.transport.relay import RelayTransport
from dcr.delta.build import Bucket
from dcr.delta.group import TrainingGroup
from dcr.engine.owner import TrainingSide
from dcr.errors import TransportError
from dcr.fleet.eventlog import NAMES_SHOWN, EventLog
from dcr.protocol.types import Mode, PayloadKey
from dcr.tensors.records import Encoding

__all__ = [
    "STALL_S",
    "TimedFetches",
    "TimedSends",
    "TimedTrainingSide",
    "report_subscription",
    "time_fetches",
]

_PAYLOAD = re.compile(rf"^{PAYLOADS}(\d{{20}})/")


def _encodings(bucket: Bucket, mode: Mode) -> dict[str, object]:
    """How the tensors of ``bucket`` travel (the fields ``built`` adds)."""
    overwrite = sorted({i.name for i in bucket.items if i.encoding is Encoding.OVERWRITE})
    relative = {i.name for i in bucket.items if i.encoding is not Encoding.OVERWRITE}
    out: dict[str, object] = {"relative": len(relative), "overwrite": len(overwrite)}
    if mode is Mode.MIXED:
        out["overwrite_names"] = overwrite[:NAMES_SHOWN]
    return out


class _TimedBuckets(Iterator[Bucket]):
    """A bucket stream whose every ``next`` records when it started and what it holds."""

    def __init__(
        self, inner: Iterator[Bucket], side: TimedTrainingSide, key: tuple[int, int], mode: Mode
    ):
        self._inner = inner
        self._side = side
        self._key = key
        self._mode = mode

    def __next__(self) -> Bucket:
        self._side.begun(self._key)
        bucket = next(self._inner)
        # A first bucket built ahead of the prepare: its build is an interval of its own.
        take = getattr(self._inner, "take_interval", None)
        ahead = take() if take is not None else None
        if ahead is not None:
            self._side.built_ahead(self._key, ahead)
        self._side.holds(self._key, _encodings(bucket, self._mode))
        return bucket


class TimedTrainingSide(TrainingSide):
    """A :class:`~dcr.engine.owner.TrainingSide` that reports ``built`` and ``baseline``."""

    def __init__(self, group: TrainingGroup, xor_allowed: Container[str], log: EventLog) -> None:
        super().__init__(group, xor_allowed)
        self._log = log
        self._begun: dict[tuple[int, int], float] = {}
        self._ahead_built: dict[tuple[int, int], tuple[float, float]] = {}
        self._held: dict[tuple[int, int], dict[str, object]] = {}
        self._begun_lock = threading.Lock()

    def begun(self, key: tuple[int, int]) -> None:
        with self._begun_lock:
            self._begun[key] = time.time()

    def built_ahead(self, key: tuple[int, int], interval: tuple[float, float]) -> None:
        with self._begun_lock:
            self._ahead_built[key] = interval

    def holds(self, key: tuple[int, int], encodings: dict[str, object]) -> None:
        with self._begun_lock:
            self._held[key] = encodings

    def stream(
        self, attempt: int, mode: Mode, rank: int, *, xor_refused: frozenset[str] | None = None
    ) -> Iterator[Bucket]:
        inner = super().stream(attempt, mode, rank, xor_refused=xor_refused)
        return _TimedBuckets(inner, self, (attempt, rank), mode)

    def add_time(self, attempt: int, rank: int, stage: str, seconds: float) -> None:
        super().add_time(attempt, rank, stage, seconds)
        if stage != "encode":
            return
        end = time.time()
        with self._begun_lock:
            start = self._begun.pop((attempt, rank), end - seconds)
            ahead = self._ahead_built.pop((attempt, rank), None)
            held = self._held.pop((attempt, rank), {})
        if ahead is not None:
            self._log.emit("built", attempt=attempt, rank=rank, start=ahead[0], end=ahead[1])
        self._log.emit("built", attempt=attempt, rank=rank, start=start, end=end, **held)

    def commit(self, rank: int) -> None:
        start = time.time()
        super().commit(rank)
        self._log.emit("baseline", rank=rank, start=start, end=time.time())


class TimedSends(TransportWrapper):
    """Delegates to ``inner`` and remembers when each payload was handed over
    (:meth:`started`), so that the owner's ``sent`` report can carry its interval."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._started: dict[PayloadKey, float] = {}

    def started(self, key: PayloadKey) -> float | None:
        """When the last successful send of ``key`` began (forgotten once asked)."""
        return self._started.pop(key, None)

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        start = time.time()
        await self.inner.send(key, data, to=to)
        if to is None:
            self._started[key] = start

    async def cleanup(self, attempt: int) -> None:
        self._started = {k: t for k, t in self._started.items() if k.attempt != attempt}
        await self.inner.cleanup(attempt)


class TimedFetches(ObjectBackend):
    """Delegates to ``inner`` and reports each payload GET as ``fetched`` (attempt, size,
    start, end): a rollout node's transport intervals and its V_cross on object storage."""

    def __init__(self, inner: ObjectBackend, log: EventLog) -> None:
        self.inner = inner
        self._log = log

    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        await self.inner.put(key, data, link=link)

    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        start = time.time()
        data = await self.inner.get(key, link=link)
        m = _PAYLOAD.match(key)
        if m is not None and data is not None:
            self._log.emit(
                "fetched", attempt=int(m[1]), size=len(data), start=start, end=time.time(),
                key=key,
            )  # fmt: skip
        return data

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def abort_uploads(self, prefix: str) -> None:
        await self.inner.abort_uploads(prefix)

    def describe(self) -> str:
        return self.inner.describe()

    async def aclose(self) -> None:
        await self.inner.aclose()


def time_fetches(transport: Transport, log: EventLog) -> None:
    """Report the payload fetches of an object-storage ``transport`` (others: nothing)."""
    if isinstance(transport, ObjectStoreTransport):
        transport.backend = TimedFetches(transport.backend, log)


STALL_S = 10.0
"""How long a receiver's untaken deliveries may stay as they are before it reports them."""


async def report_subscription(
    transport: Transport,
    log: EventLog,
    receiver: str,
    *,
    every_s: float = 0.5,
    stall_s: float = STALL_S,
) -> None:
    """Until cancelled, check every ``every_s`` what a relay ``transport``'s subscription of
    ``receiver`` dropped and holds: emit ``drops`` (the counts per reason) each time they
    change, and ``untaken`` (``count``, ``seconds``) once per stall when the deliveries it
    holds untaken stayed as many, and more than none, for ``stall_s``.  Other transports:
    return."""
    while isinstance(transport, TransportWrapper):
        transport = transport.inner
    if not isinstance(transport, RelayTransport):
        return
    last: dict[str, int] = {}
    held, since, told = 0, time.monotonic(), False
    while True:
        now = dict(transport.drops())
        if now != last:
            log.emit("drops", drops=now)
            last = now
        try:
            count = transport.held(receiver).count
        except TransportError:
            count = 0  # not subscribed (yet, or any more)
        t = time.monotonic()
        if count != held:
            held, since, told = count, t, False
        elif held and not told and t - since >= stall_s:
            log.emit("untaken", count=held, seconds=round(t - since, 1))
            told = True
        await anyio.sleep(every_s)
