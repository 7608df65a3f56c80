"""The owner engine: runs :class:`~dcr.protocol.owner.OwnerCore` on anyio.

Construction (change detection, projection, packing, zstd) runs in worker threads, one bucket
at a time, while earlier payloads are being sent (paper §7.2: bucket ``l+1`` is built while
payload ``l`` is sent).  Baseline updates and dense refits of joining receivers run in worker
threads too.  The core decides what happens; this module only does it and reports back.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel, EndpointLink
from dcr.adapters.transport.base import Transport
from dcr.catalog import check_catalog
from dcr.delta.build import Bucket, BuildStats
from dcr.delta.group import TrainingGroup
from dcr.delta.proof import owner_proof
from dcr.engine.integration import Integration, default_limiter, serving
from dcr.errors import DcrError, TransportError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import OwnerPhase
from dcr.protocol.owner import OwnerCore
from dcr.protocol.types import CommitRecord, Mode, PayloadKey
from dcr.wire.payload import encode_bucket
from dcr.wire.seal import payload_key

__all__ = ["OwnerService", "TrainingSide", "open_owner"]


class _AheadBuckets(Iterator[Bucket]):
    """A bucket iterator whose first bucket may be built before the attempt exists.

    :meth:`build_first` (a worker thread, ahead of the prepare) and the first
    :meth:`__next__` (the attempt's builder) both run the first build through one lock: the
    first to arrive builds, the other waits for it, so neither waits on a thread that is not
    running.  Later buckets come straight from the inner iterator.
    """

    def __init__(self, inner: Iterator[Bucket]) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._ran = False
        self._first: Bucket | None = None
        self._error: BaseException | None = None
        self._interval: tuple[float, float] | None = None

    def build_first(self) -> None:
        with self._lock:
            if self._ran:
                return
            self._ran = True
            start = time.time()
            try:
                self._first = next(self._inner, None)
            except BaseException as exc:  # handed to the attempt's builder
                self._error = exc
            self._interval = (start, time.time())

    def take_interval(self) -> tuple[float, float] | None:
        """When the first bucket's build began and ended (``time.time()``): once, after it
        ran; ``None`` before and after."""
        with self._lock:
            interval, self._interval = self._interval, None
        return interval

    def __next__(self) -> Bucket:
        if not self._ran:
            self.build_first()
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._first is not None:
                first, self._first = self._first, None
                return first
        return next(self._inner)

    def close(self) -> None:
        self._first = None
        close = getattr(self._inner, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # executing: its builder is still inside it
                close()


@dataclass(slots=True)
class _Ahead:
    """Bucket streams started for the staged candidate before any attempt asked for them."""

    staged: object
    mode: Mode
    xor_refused: frozenset[str] | None
    streams: dict[int, tuple[Iterator[Bucket], BuildStats]]

    def serves(self, staged: object, mode: Mode, xor_refused: frozenset[str] | None) -> bool:
        """Whether these streams are what an attempt of ``mode`` binding ``xor_refused`` on
        the candidate ``staged`` builds (overwrite mode encodes no name relative)."""
        return (
            self.staged is staged
            and self.mode is mode
            and (mode is not Mode.MIXED or self.xor_refused == xor_refused)
        )

    def close(self) -> None:
        for it, _ in self.streams.values():
            if isinstance(it, _AheadBuckets):
                it.close()


class TrainingSide:
    """The training side shared by the owner engines of one trainer process.

    Each attempt's construction starts once for all owners hosted here; each owner engine
    then pulls its own buckets.  The collective steps (residual change flags OR-reduced,
    residual tensors gathered, across processes for a distributed group) already ran when the
    trainer staged the candidate, so construction never waits on another process.

    What mixed mode encodes relative to the old bits is the attempt's: the catalog names not
    in its prepare's ``xor_refused`` (the union of the required receivers' loader
    classifications).  ``xor_allowed`` is the fallback for a prepare that binds none (the
    integration setup's ``xor_names``; ``frozenset()`` sends every element as an overwrite).

    :meth:`build_ahead` starts the next attempt's construction before its prepare arrives:
    the first attempt of a transition whose mode and refused set match takes those streams
    over, so the coordinator's round trip (prepare, proofs, acceptances) overlaps the first
    bucket.
    """

    def __init__(self, group: TrainingGroup, xor_allowed: Container[str]) -> None:
        self.group = group
        self.xor_allowed = xor_allowed
        self._lock = threading.Lock()
        self._streams: dict[int, dict[int, tuple[Iterator[Bucket], BuildStats]]] = {}
        self._ahead: _Ahead | None = None
        self._claimed: object | None = None
        """The staged candidate an attempt's streams were started for (no build ahead)."""

    def relative_names(self, xor_refused: frozenset[str] | None) -> Container[str]:
        """What mixed mode may encode relative under a prepare binding ``xor_refused``: the
        catalog names not in it, or :attr:`xor_allowed` when it binds none."""
        if xor_refused is None:
            return self.xor_allowed
        return frozenset(self.group.catalog).difference(xor_refused)

    def stream(
        self, attempt: int, mode: Mode, rank: int, *, xor_refused: frozenset[str] | None = None
    ) -> Iterator[Bucket]:
        """The bucket iterator of owner ``rank`` for ``attempt`` (started on first use, or
        taken over from :meth:`build_ahead` when it built for the staged candidate in
        ``mode`` and, in mixed mode, with the same ``xor_refused``: the attempt's prepare's
        set of names that travel as overwrites; ``None``: the side's :attr:`xor_allowed`)."""
        with self._lock:
            if attempt not in self._streams:
                ahead, self._ahead = self._ahead, None
                self._claimed = self.group.staged
                if ahead is not None and ahead.serves(self.group.staged, mode, xor_refused):
                    self._streams[attempt] = ahead.streams
                else:
                    if ahead is not None:
                        ahead.close()
                    self._streams[attempt] = self.group.build(
                        mode=mode, xor_allowed=self.relative_names(xor_refused)
                    )
            return self._streams[attempt][rank][0]

    def build_ahead(
        self, mode: Mode, rank: int, *, xor_refused: frozenset[str] | None = None
    ) -> None:
        """Build owner ``rank``'s first bucket of the staged candidate in ``mode`` (with
        ``xor_refused``, as :meth:`stream`) now, in the calling thread, for the attempt that
        will ask for it.  Nothing is built without a staged candidate; a build the attempt
        does not take (another mode or refused set, a candidate staged again) is closed
        unused."""
        with self._lock:
            staged = self.group.staged
            if staged is None or staged is self._claimed:
                return  # nothing staged, or an attempt already builds it
            ahead = self._ahead
            if ahead is None or not ahead.serves(staged, mode, xor_refused):
                if ahead is not None:
                    ahead.close()
                streams = self.group.build(mode=mode, xor_allowed=self.relative_names(xor_refused))
                ahead = self._ahead = _Ahead(
                    staged=staged,
                    mode=mode,
                    xor_refused=xor_refused,
                    streams={r: (_AheadBuckets(it), st) for r, (it, st) in streams.items()},
                )
            first = ahead.streams[rank][0]
        assert isinstance(first, _AheadBuckets)
        first.build_first()

    def forget_ahead(self) -> None:
        """Close what :meth:`build_ahead` started and no attempt took (the candidate is
        staged again or dropped)."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
            self._claimed = None
        if ahead is not None:
            ahead.close()

    def dense(self, rank: int) -> Iterator[Bucket]:
        """Every element owner ``rank`` is responsible for at its committed baseline."""
        with self._lock:
            return self.group.build_dense()[rank][0]

    def add_time(self, attempt: int, rank: int, stage: str, seconds: float) -> None:
        with self._lock:
            streams = self._streams.get(attempt)
            if streams is not None:
                streams[rank][1].add_time(stage, seconds)

    def stats(self, attempt: int) -> BuildStats:
        """Construction counters of ``attempt`` summed over owners."""
        total = BuildStats()
        with self._lock:
            for _, st in self._streams.get(attempt, {}).values():
                total.merge(st)
        return total

    def release(self, attempt: int) -> None:
        with self._lock:
            self._streams.pop(attempt, None)

    def close(self, attempt: int, rank: int) -> None:
        """End owner ``rank``'s bucket iterator of ``attempt`` where it stands (a stopped or
        rejected attempt): it lets go of the candidate, the blocks compared ahead and the
        bucket it was filling.  Its stats stay readable.  No-op for an iterator that ran to
        its end or is running in another thread."""
        with self._lock:
            entry = self._streams.get(attempt, {}).get(rank)
        close = getattr(entry[0], "close", None) if entry is not None else None
        if close is not None:
            with contextlib.suppress(ValueError):  # executing: its builder is still inside it
                close()

    def commit(self, rank: int) -> None:
        """Owner ``rank`` writes its staged candidate into its trackers (idempotent)."""
        self.group.commit(rank)


class _BuildAhead:
    """Local event: the trainer published a candidate; start its first bucket."""


_AHEAD_PHASES = frozenset({OwnerPhase.IDLE, OwnerPhase.UPDATED})
"""Owner phases between attempts: no attempt builds the staged candidate yet."""
_REFUSED_KEPT = 4
"""How many of the latest attempts' refused sets an owner engine keeps."""


@dataclass(slots=True)
class OwnerService:
    """One owner endpoint: the protocol core plus the work it asks for.

    ``sends_in_flight`` bounds the payloads handed to the transport and not yet accepted (a
    transport that confirms delivery, like the relay tree, needs several to keep its links
    busy).  ``incarnation`` distinguishes this process from earlier ones of the same name.
    """

    name: str
    rank: int
    side: TrainingSide
    integration: Integration
    control: ControlChannel
    transport: Transport
    store: CommitStore
    baseline: CommitRecord
    limiter: anyio.CapacityLimiter = field(default_factory=default_limiter)
    sends_in_flight: int = 1
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_sent: Callable[[PayloadKey, int], None] | None = None
    """Called with the key and size of each attempt payload the transport accepted (fault
    injection, progress, traffic reports)."""
    build_ahead: bool = True
    """Whether :meth:`publish` starts building the first bucket right away, in the mode and
    with the refused set of the last prepare this owner received, so that the prepare's
    round trip overlaps it (:meth:`TrainingSide.build_ahead`); an attempt in another mode or
    with another set builds afresh."""
    fleet_secret: bytes | None = field(default=None, repr=False)
    """The fleet's 32-byte secret: every payload is sealed with its payload key
    (:mod:`dcr.wire.seal`), as receivers holding it require.  ``None``: unkeyed digests."""
    core: OwnerCore = field(init=False)
    link: EndpointLink | None = None
    _seal_key: bytes | None = field(default=None, init=False, repr=False)
    _payloads: dict[tuple[int, int], bytes] = field(default_factory=dict)
    _stopped: set[int] = field(default_factory=set)
    _sending: dict[int, set[anyio.CancelScope]] = field(default_factory=dict)
    """Attempt -> the sends in flight; a stopped attempt's sends are cancelled (a send to a
    peer that died may otherwise wait forever, and the stop waits for every send)."""
    _events: MemoryObjectSendStream[object] | None = None
    _updated: anyio.Event = field(default_factory=anyio.Event)
    _mode: Mode = Mode.MIXED
    """The mode of the last prepare: what a build ahead predicts for the next attempt."""
    _xor_refused: frozenset[str] | None = None
    """The refused set of the last prepare, which a build ahead predicts likewise."""
    _refused: dict[int, frozenset[str] | None] = field(default_factory=dict)
    """Attempt -> the ``xor_refused`` its prepare bound (what its buckets encode as
    overwrites in mixed mode)."""

    def __post_init__(self) -> None:
        # Receivers admit payloads against the integration's catalog: a training side built
        # on another one (another checkpoint, dtype or vocabulary) would fail every attempt.
        check_catalog(
            self.integration.catalog,
            self.side.group.catalog,
            expected_from="the integration setup (what receivers admit)",
            found_from=f"owner {self.name}'s training plan",
        )
        self._seal_key = payload_key(self.fleet_secret)
        self.core = OwnerCore(
            self.name,
            baseline=self.baseline,
            sends_in_flight=self.sends_in_flight,
            staged=self.side.group.staged is not None,
        )

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve control calls until cancelled."""
        link = self.link = await self.control.endpoint(self.name)
        send, recv = anyio.create_memory_object_stream[object](math.inf)
        self._events = send
        try:
            with send, recv:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._forward, link.calls(), send)
                    await self._report_status()
                    task_status.started()
                    async for message in recv:
                        await self._handle(message, tg)
        finally:
            with anyio.CancelScope(shield=True):
                await link.aclose()

    async def staged(self, candidate: bool = True) -> None:
        """The trainer staged (or dropped) the next version: the core takes a prepare it held
        back for it, and the coordinators are told (:class:`~dcr.protocol.events.
        CandidateStaged`)."""
        self.side.forget_ahead()
        await self._local(ev.CandidateStaged(staged=candidate))

    async def publish(
        self, candidate: Mapping[str, torch.Tensor], *, donate: bool = False
    ) -> CommitRecord:
        """Hand the next version to the owner after the optimizer step; the one call a
        trainer makes.

        Stages ``candidate`` (this rank's shards; a distributed group OR-reduces its residual
        flags here, so every rank of the trainer calls it at the same step), tells the
        coordinators, and returns the commit record once the transition committed it and
        this owner's baseline moved to it.  ``donate=True`` lets the owner keep the
        candidate's tensors as its baseline instead of copying them at commit; the trainer
        must not write them again (it steps on a clone, or exports fresh tensors each step).
        """
        base = self.core.baseline
        stage = partial(self.side.group.stage, candidate, donate=donate)
        await anyio.to_thread.run_sync(stage, limiter=self.limiter)
        await self.staged(True)
        if self.build_ahead and self._events is not None:
            await self._local(_BuildAhead())
        while self.core.baseline == base:
            await self._updated.wait()
            self._updated = anyio.Event()
        return self.core.baseline

    async def _report_status(self) -> None:
        if self.link is not None:
            await self.link.set_status(
                msg.EndpointStatus(
                    endpoint=self.name,
                    role="owner",
                    incarnation=self.incarnation,
                    record=self.core.baseline,
                    candidate=self.core.staged,
                )
            )

    @staticmethod
    async def _forward(
        calls: AsyncIterator[msg.Call], send: MemoryObjectSendStream[object]
    ) -> None:
        async for message in calls:
            await send.send(message)

    async def _local(self, event: object) -> None:
        assert self._events is not None
        await self._events.send(event)

    async def _handle(self, message: object, tg: TaskGroup) -> None:
        if isinstance(message, _BuildAhead):
            if self.core.phase in _AHEAD_PHASES and not self.core.holding:
                tg.start_soon(self._build_ahead)
            return
        if isinstance(message, msg.Prepare):
            self._mode = message.info.mode
            self._xor_refused = message.xor_refused
            self._bind_refused(message.info.attempt, message.xor_refused)
        if isinstance(message, msg.Prepare | ev.PrepareChecked):
            # A trainer may stage on the group directly instead of through publish(): what
            # the group holds now is what the core decides on.
            staged = self.side.group.staged is not None
            if staged != self.core.staged:
                await self._handle(ev.CandidateStaged(staged=staged), tg)
        if isinstance(message, msg.Prepare) and message.proof is not None:
            tg.start_soon(self._prove, message)
            return
        for c in self.core.handle(message):  # type: ignore[arg-type]
            await self._execute(c, tg)
        if isinstance(message, ev.CandidateStaged):
            await self._report_status()

    def _bind_refused(self, attempt: int, xor_refused: frozenset[str] | None) -> None:
        """Remember what ``attempt``'s prepare bound (its first prepare: the coordinator
        sends one set per attempt), for the few latest attempts."""
        self._refused.setdefault(attempt, xor_refused)
        for old in sorted(self._refused)[:-_REFUSED_KEPT]:
            del self._refused[old]

    async def _build_ahead(self) -> None:
        # A failure here is the attempt's to report: it builds afresh.
        build = partial(self.side.build_ahead, self._mode, self.rank, xor_refused=self._xor_refused)
        with contextlib.suppress(DcrError):
            await anyio.to_thread.run_sync(build, limiter=self.limiter)

    async def _prove(self, message: msg.Prepare) -> None:
        """This owner's proof of its committed version, computed in a worker thread."""
        assert message.proof is not None
        proof = None
        try:
            owner = self.side.group.owner(self.rank)
            proof = await anyio.to_thread.run_sync(
                owner_proof, owner, message.proof, limiter=self.limiter
            )
        except DcrError:
            proof = None  # the tensors it owns go unchecked this time
        await self._local(ev.PrepareChecked(info=message.info, proof=proof))

    async def _execute(self, c: cmd.OwnerCommand, tg: TaskGroup) -> None:
        match c:
            case cmd.Notify(message=message):
                assert self.link is not None
                await self.link.notify(message)
                if isinstance(message, msg.BaselineUpdated):
                    await self._report_status()
                    self._updated.set()
            case cmd.BuildBucket(attempt=tau, payload_id=pid, mode=mode):
                tg.start_soon(self._build, tau, pid, mode)
            case cmd.SendPayload(attempt=tau, payload_id=pid):
                tg.start_soon(self._send, tau, pid)
            case cmd.StopStreaming(attempt=tau):
                self._stop_sends(tau)
            case cmd.FetchRecord():
                tg.start_soon(self._fetch_record)
            case cmd.UpdateBaseline(record=record):
                tg.start_soon(self._update_baseline, record)
            case cmd.SendDense(job=job, to=to):
                tg.start_soon(self._send_dense, job, to)
            case cmd.Release(attempt=tau):
                self._stop_sends(tau)
                self.side.close(tau, self.rank)
                for key in [k for k in self._payloads if k[0] == tau]:
                    del self._payloads[key]

    def _stop_sends(self, attempt: int) -> None:
        self._stopped.add(attempt)
        for scope in self._sending.pop(attempt, ()):
            scope.cancel()

    def _encode(self, attempt: int, payload_id: int, bucket: Bucket) -> bytes:
        return encode_bucket(
            items=bucket.items,
            attempt=attempt,
            owner=self.integration.owner_ids[self.name],
            payload_id=payload_id,
            final=bucket.final,
            level=self.integration.zstd_level,
            layout=self.integration.value_layout,
            seal_key=self._seal_key,
        )

    def _encode_next(self, attempt: int, payload_id: int, mode: Mode) -> tuple[bytes, bool]:
        stream = self.side.stream(attempt, mode, self.rank, xor_refused=self._refused.get(attempt))
        bucket = next(stream, None)
        if bucket is None:
            raise DcrError(
                f"owner {self.name} has no bucket {payload_id}", attempt=attempt, check="encode"
            )
        t0 = time.perf_counter()
        data = self._encode(attempt, payload_id, bucket)
        self.side.add_time(attempt, self.rank, "encode", time.perf_counter() - t0)
        return data, bucket.final

    async def _build(self, attempt: int, payload_id: int, mode: Mode) -> None:
        failure = None
        final = False
        if attempt in self._stopped:
            return
        try:
            data, final = await anyio.to_thread.run_sync(
                self._encode_next, attempt, payload_id, mode, limiter=self.limiter
            )
            self._payloads[(attempt, payload_id)] = data
        except DcrError as exc:
            failure = f"encode: {exc}"
        await self._local(
            ev.BucketBuilt(attempt=attempt, payload_id=payload_id, final=final, failure=failure)
        )

    async def _send(self, attempt: int, payload_id: int) -> None:
        data = self._payloads.get((attempt, payload_id))
        failure = None
        key = PayloadKey(attempt=attempt, owner=self.name, payload_id=payload_id)
        if data is None or attempt in self._stopped:
            failure = "released" if data is None else "stopped"
        else:
            with anyio.CancelScope() as scope:
                self._sending.setdefault(attempt, set()).add(scope)
                try:
                    await self.transport.send(key, data)
                except TransportError as exc:
                    failure = f"transport: {exc}"
                finally:
                    scopes = self._sending.get(attempt)
                    if scopes is not None:
                        scopes.discard(scope)
                        if not scopes:
                            del self._sending[attempt]
            if scope.cancelled_caught:
                failure = "stopped"
        await self._local(ev.PayloadSent(attempt=attempt, payload_id=payload_id, failure=failure))
        if failure is None and self.on_sent is not None and data is not None:
            self.on_sent(key, len(data))

    async def _fetch_record(self) -> None:
        await self._local(ev.CommitRecordRead(record=(await self.store.read()).record))

    async def _update_baseline(self, record: CommitRecord) -> None:
        failure = None
        try:
            await anyio.to_thread.run_sync(self.side.commit, self.rank, limiter=self.limiter)
        except DcrError as exc:
            failure = str(exc)
        await self._local(ev.BaselineWritten(record=record, failure=failure))

    async def _send_dense(self, job: int, to: frozenset[str]) -> None:
        """Build and send one payload at a time (bounded memory), every element overwrite."""
        sent = 0
        failure = None
        try:
            buckets = await anyio.to_thread.run_sync(self.side.dense, self.rank)
            while True:
                pid = sent
                data = await anyio.to_thread.run_sync(
                    self._encode_dense, buckets, job, pid, limiter=self.limiter
                )
                if data is None:
                    break
                key = PayloadKey(attempt=job, owner=self.name, payload_id=pid)
                await self.transport.send(key, data, to=to)
                sent += 1
        except (DcrError, TransportError) as exc:
            failure = str(exc)
        await self._local(ev.DenseSent(job=job, payloads=sent, failure=failure))

    def _encode_dense(self, buckets: Iterator[Bucket], job: int, pid: int) -> bytes | None:
        bucket = next(buckets, None)
        return None if bucket is None else self._encode(job, pid, bucket)


@asynccontextmanager
async def open_owner(**options: Any) -> AsyncIterator[OwnerService]:
    """Build a :class:`OwnerService` from ``options`` (its fields) and serve it for the duration
    of the block, in a task group of its own::

        async with open_owner(name=..., ...) as service:
            ...
    """
    async with serving(OwnerService(**options)) as service:
        yield service
