"""The request gate of a running vLLM engine, closed and opened by its receiver ranks.

One engine serves with all its workers at once, so its gate is one thing shared by the
receiver ranks it hosts (one per worker, paper §7.2): it is closed while *any* rank keeps it
closed and opens only when every rank reopened it at the same committed record.  Closing is
the engine's own pause (vLLM 0.32 ``pause_generation``): ``"wait"`` lets in-flight requests
finish first, ``"keep"`` freezes them in the scheduler so they resume on the new weights,
``"abort"`` ends them; in every mode new requests queue in the engine and wait instead of
failing.  Before the gate reopens, the prefix and KV caches are dropped
(``reset_prefix_cache``; frozen requests are recomputed on the new weights), the engine's
weight version is set to the record (so every request reports which version produced which
tokens, see :mod:`dcr.integrations.vllm.versions`), and generation resumes.

The ranks live in the engine's worker processes; they reach the gate of the engine process
through a small ZeroMQ call (:class:`GateServer` there, :class:`GateClient` in each worker),
one strict MessagePack frame each way, bound to 127.0.0.1.  A rank closing for an attempt says
whether the attempt is synchronous, so that by default the engine pauses as the RL mode
wants: ``"wait"`` in synchronous RL (the rollout batch finishes on the weights it started
with), ``"keep"`` in asynchronous RL (the engine keeps its requests and the gate stays closed
only for decode and apply).

The gate's lock also orders what the engine process itself does to the engine:
:meth:`EngineGate.admit` adds a batch of requests so that all of them enter the scheduler at
one step (see :func:`~dcr.integrations.vllm.generation.generate_batch`), and an engine outside any
fleet (a reference engine: a gate with ``receivers=False``) replaces its weights by a dense
load under :meth:`EngineGate.replacing` and labels them with :meth:`EngineGate.label`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from dcr.errors import ConfigError, DcrError, LocalProtocolError, RemoteProtocolError
from dcr.integrations.vllm.versions import UNCONFIRMED, label_of
from dcr.protocol.types import CommitRecord

__all__ = [
    "PAUSE_MODES",
    "EngineGate",
    "GateClient",
    "GateCycle",
    "GateServer",
    "PauseMode",
    "Replacement",
    "serving",
]

T = TypeVar("T")

PauseMode = Literal["wait", "keep", "abort"]
PAUSE_MODES: tuple[PauseMode, ...] = ("wait", "keep", "abort")

_MAX_FRAME = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class GateCycle:
    """One closing of the engine's gate, in wall-clock seconds (``time.time()``).

    ``requested`` is when the first rank asked to close (from then on no new request is
    admitted), ``paused`` when the engine was idle (in-flight requests finished, frozen or
    aborted), ``opened`` when it resumed at ``record``.
    """

    requested: float
    paused: float
    opened: float
    record: CommitRecord

    @property
    def drain_s(self) -> float:
        """Seconds from the request to close until the engine was idle."""
        return self.paused - self.requested

    @property
    def closed_s(self) -> float:
        """Seconds during which the engine admitted no request."""
        return self.opened - self.requested

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.record.version,
            "candidate": self.record.candidate,
            "requested": self.requested,
            "paused": self.paused,
            "opened": self.opened,
            "drain_s": self.drain_s,
            "closed_s": self.closed_s,
        }


@dataclass(slots=True)
class EngineGate:
    """The gate of ``engine`` (a vLLM ``AsyncLLM`` or anything with its pause, resume,
    cache-reset and weight-version coroutines) for receiver ranks ``0 .. ranks-1``.

    ``pause_mode`` fixes how closing pauses the engine; ``None`` (the default) pauses per
    attempt: ``"wait"`` for a synchronous one, ``"keep"`` for an asynchronous one, ``"wait"``
    when no attempt is running (a rank joining without a confirmed version, or one whose
    proof of the base version failed).  Ranks start closed; :meth:`join` says what each one
    holds when it starts.

    ``receivers=False`` makes the gate of an engine whose workers host no receivers (a
    reference engine): no rank closes or opens it; the engine process labels the weights
    (:meth:`label`) and replaces them by dense loads (:meth:`replacing`).
    """

    engine: Any
    ranks: int
    pause_mode: PauseMode | None = None
    receivers: bool = True
    cycles: list[GateCycle] = field(default_factory=list)
    record: CommitRecord | None = None
    """The committed record the engine's weights are labelled with (``None`` until every
    rank confirmed one)."""
    _closed: set[int] = field(default_factory=set)
    _held: dict[int, CommitRecord] = field(default_factory=dict)
    _paused: bool = False
    _requested: float | None = None
    _paused_at: float | None = None
    _lock: anyio.Lock = field(default_factory=anyio.Lock)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"an engine gate needs at least one rank, got {self.ranks}")
        if self.pause_mode is not None and self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        self._closed = set(range(self.ranks)) if self.receivers else set()

    @property
    def closed(self) -> bool:
        """Whether the engine admits no new generation request."""
        return self._paused

    def state(self) -> dict[str, Any]:
        return {
            "closed": self._paused,
            "closed_by": sorted(self._closed),
            "record": None if self.record is None else label_of(self.record),
            "pause_mode": self.pause_mode,
            "cycles": [c.as_dict() for c in self.cycles],
        }

    async def join(self, rank: int, held: CommitRecord | None) -> None:
        """Rank ``rank`` starts holding ``held`` exactly (gate open for it), or nothing
        confirmed yet (``None``: it keeps the gate closed until it reopens it)."""
        self._check(rank)
        if held is None:
            await self.close(rank)
        else:
            await self.open(rank, held)

    async def close(self, rank: int, *, sync: bool | None = None) -> None:
        """Rank ``rank`` closes the gate for a synchronous (``sync=True``) or asynchronous
        attempt, or for none (``None``); returns once the engine admits no request and no
        forward pass runs."""
        self._check(rank)
        async with self._lock:
            self._closed.add(rank)
            if self._paused:
                return
            self._requested = time.time()
            mode = self.pause_mode or ("keep" if sync is False else "wait")
            await self.engine.pause_generation(mode=mode, clear_cache=False)
            self._paused = True
            self._paused_at = time.time()

    async def invalidate(self, rank: int) -> None:
        """Drop the prefix and KV caches computed with the weights being replaced (requests
        frozen in flight are preempted and recomputed when generation resumes).

        While the engine serves, its weights are the committed ones every rank holds and its
        caches were computed with them: nothing to drop (a rank that reopens after an attempt
        that never closed the gate)."""
        self._check(rank)
        async with self._lock:
            if self._paused:
                await self.engine.reset_prefix_cache(
                    reset_running_requests=True, reset_connector=True
                )

    async def open(self, rank: int, record: CommitRecord) -> None:
        """Rank ``rank`` holds ``record`` and reopens the gate; the engine resumes once every
        rank did, at one record (ranks that disagree keep it paused)."""
        self._check(rank)
        async with self._lock:
            self._closed.discard(rank)
            self._held[rank] = record
            if self._closed or len(self._held) < self.ranks:
                return
            if len(set(self._held.values())) != 1:
                # The ranks hold different committed records: serve none of them until the
                # protocol brings them to one (a rank behind is restored by dense refit).
                if not self._paused:
                    self._requested = time.time()
                    await self.engine.pause_generation(mode="wait", clear_cache=False)
                    self._paused = True
                    self._paused_at = time.time()
                self.record = None
                return
            self.record = record
            await self.engine.update_weight_version(label_of(record))
            if self._paused:
                await self.engine.resume_generation()
                now = time.time()
                requested = self._requested if self._requested is not None else now
                paused = self._paused_at if self._paused_at is not None else now
                self.cycles.append(
                    GateCycle(requested=requested, paused=paused, opened=now, record=record)
                )
                self._paused = False

    # -- what the engine process does under the gate's lock --------------------------------

    async def admit(self, add: Callable[[], Awaitable[T]]) -> T:
        """Run ``add`` -- which adds requests to the engine -- so that all it adds enter the
        scheduler at one step, and return what it returns.

        While the gate is open the engine is paused for it in ``"wait"`` mode (requests in
        flight finish first, so the added ones start on an idle engine, together and alone)
        and resumed right after: the engine core handles the adds, then the resume, in the
        order they were sent, so its first step after the resume schedules all of them.
        While the gate is closed (a refit), the added requests wait with every other queued
        request and start when it reopens.  The gate's lock is held throughout: no rank closes
        or opens the gate, no dense load starts, and no other batch is added in between.
        """
        async with self._lock:
            if self._paused:
                return await add()
            with anyio.CancelScope(shield=True):  # never left paused by a cancellation
                await self.engine.pause_generation(mode="wait", clear_cache=False)
            try:
                return await add()
            finally:
                with anyio.CancelScope(shield=True):
                    await self.engine.resume_generation()

    async def label(self, record: CommitRecord) -> None:
        """An engine without receivers holds ``record`` (the checkpoint it was started from):
        requests report it from now on."""
        self.require_no_receivers()
        async with self._lock:
            await self.engine.update_weight_version(label_of(record))
            self.record = record

    @asynccontextmanager
    async def replacing(self) -> AsyncIterator[Replacement]:
        """Hold the engine of a gate without receivers paused while the block replaces its
        weights (a dense load through the workers).

        The engine pauses in ``"wait"`` mode (requests in flight finish on the old weights;
        new ones queue).  The block reports through the :class:`Replacement` it gets what the
        weights hold; when it ends -- normally or not -- the prefix and KV caches are dropped
        if the weights changed, the engine is labelled with the new record (or
        :data:`~dcr.integrations.vllm.versions.UNCONFIRMED` when a failed load left them
        unknown) and generation resumes.  A successful replacement is kept as a
        :class:`GateCycle` in :attr:`cycles`.
        """
        self.require_no_receivers()
        async with self._lock:
            requested = time.time()
            with anyio.CancelScope(shield=True):  # never left paused by a cancellation
                await self.engine.pause_generation(mode="wait", clear_cache=False)
            self._paused = True
            paused_at = time.time()
            swap = Replacement(record=self.record)
            try:
                yield swap
            finally:
                with anyio.CancelScope(shield=True):
                    try:
                        if swap.changed:
                            self.record = swap.record
                            await self.engine.reset_prefix_cache(
                                reset_running_requests=True, reset_connector=True
                            )
                            label = UNCONFIRMED if swap.record is None else label_of(swap.record)
                            await self.engine.update_weight_version(label)
                    finally:
                        await self.engine.resume_generation()
                        self._paused = False
                    if swap.changed and swap.record is not None:
                        self.cycles.append(
                            GateCycle(
                                requested=requested,
                                paused=paused_at,
                                opened=time.time(),
                                record=swap.record,
                            )
                        )

    def require_no_receivers(self) -> None:
        """Raise :class:`~dcr.errors.ConfigError` (``check="fleet"``) when receiver ranks
        drive this gate: only an engine outside any fleet takes weights from its process."""
        if self.receivers:
            raise ConfigError(
                "the engine's workers are receivers of a fleet: its weights change only by "
                "refits of that fleet",
                check="fleet",
            )

    def _check(self, rank: int) -> None:
        if not self.receivers:
            raise ConfigError(
                f"rank {rank} called the gate of an engine whose workers host no receivers",
                check="gate",
            )
        if not 0 <= rank < self.ranks:
            raise ConfigError(f"rank {rank} outside the engine's {self.ranks} ranks")


@dataclass(slots=True)
class Replacement:
    """What the weights of an engine hold while :meth:`EngineGate.replacing` holds it paused.

    The block calls :meth:`writing` before anything may write into the weights and
    :meth:`done` once they hold a record exactly; :meth:`unchanged` undoes :meth:`writing`
    when nothing was written after all.
    """

    record: CommitRecord | None
    """What the weights hold: the record the engine was labelled with before, the new one,
    or ``None`` while (or after) a write of unknown outcome."""
    changed: bool = False
    _before: CommitRecord | None = None

    def __post_init__(self) -> None:
        self._before = self.record

    def writing(self) -> None:
        """The weights are being written: they hold no known record until :meth:`done`."""
        self.changed, self.record = True, None

    def unchanged(self) -> None:
        """Nothing was written: the weights still hold what they held before."""
        self.changed, self.record = False, self._before

    def done(self, record: CommitRecord) -> None:
        """The weights now hold ``record`` exactly."""
        self.changed, self.record = True, record


# -- worker <-> engine calls ---------------------------------------------------------------


class GateCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A receiver rank's request to the engine gate."""

    call: int
    rank: int
    op: Literal["close", "invalidate", "open"]
    version: int | None = None
    candidate: str | None = None
    sync: bool | None = None
    """For ``close``: whether the attempt closing the gate is synchronous (``None``: none)."""


class GateReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    call: int
    error: str | None = None


_CALLS = msgspec.msgpack.Decoder(GateCall)
_REPLIES = msgspec.msgpack.Decoder(GateReply)
_ENCODE = msgspec.msgpack.Encoder()


class GateServer:
    """Serves :class:`GateCall` frames for ``gate`` on a ROUTER socket (engine process)."""

    def __init__(self, gate: EngineGate, *, host: str = "127.0.0.1") -> None:
        import zmq
        import zmq.asyncio

        self.gate = gate
        self.drops = 0
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Answer calls until cancelled; each call runs in its own task (the gate's lock
        orders them), so one rank's long pause does not hold up another rank's call."""
        async with anyio.create_task_group() as tg:
            task_status.started()
            while True:
                frames = await self._sock.recv_multipart()
                if len(frames) != 2 or len(frames[1]) > _MAX_FRAME:
                    self.drops += 1
                    continue
                try:
                    call = _CALLS.decode(frames[1])
                except msgspec.DecodeError:
                    self.drops += 1
                    continue
                tg.start_soon(self._answer, frames[0], call)

    async def _answer(self, peer: bytes, call: GateCall) -> None:
        error = None
        try:
            if call.op == "close":
                await self.gate.close(call.rank, sync=call.sync)
            elif call.op == "invalidate":
                await self.gate.invalidate(call.rank)
            elif call.version is None or call.candidate is None:
                raise RemoteProtocolError("an open call names no record", check="gate-version")
            else:
                record = CommitRecord(version=call.version, candidate=call.candidate)
                await self.gate.open(call.rank, record)
        except DcrError as exc:
            error = str(exc)
        await self._sock.send_multipart(
            [peer, _ENCODE.encode(GateReply(call=call.call, error=error))]
        )

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


@asynccontextmanager
async def serving(server: GateServer) -> AsyncIterator[GateServer]:
    """``server`` answers calls in the current event loop (asyncio) for the block; it is
    closed when the block ends."""
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            try:
                yield server
            finally:
                tg.cancel_scope.cancel()
    finally:
        server.close()


class GateClient:
    """A receiver rank's end of the gate calls (in a worker process's receiver loop).

    Calls are sent one at a time; each waits at most ``timeout_s`` for its answer (a
    ``"wait"`` pause lasts as long as the longest request in flight).
    """

    def __init__(self, address: str, rank: int, *, timeout_s: float = 3600.0) -> None:
        import zmq
        import zmq.asyncio

        self.rank = rank
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._lock = anyio.Lock()

    async def call(
        self,
        op: Literal["close", "invalidate", "open"],
        record: CommitRecord | None = None,
        *,
        sync: bool | None = None,
    ) -> None:
        """Ask the engine gate for ``op``; raises :class:`RemoteProtocolError` when the gate
        refused it and :class:`LocalProtocolError` when no answer came in time."""
        message = GateCall(
            call=next(self._ids),
            rank=self.rank,
            op=op,
            version=None if record is None else record.version,
            candidate=None if record is None else record.candidate,
            sync=sync,
        )
        async with self._lock:
            await self._sock.send(_ENCODE.encode(message))
            with anyio.move_on_after(self.timeout_s) as scope:
                while True:
                    frame = await self._sock.recv()
                    try:
                        reply = _REPLIES.decode(frame)
                    except msgspec.DecodeError:
                        continue
                    if reply.call == message.call:
                        break
            if scope.cancelled_caught:
                raise LocalProtocolError(
                    f"the engine gate did not answer {op!r} within {self.timeout_s} s",
                    check="gate-timeout",
                )
        if reply.error is not None:
            raise RemoteProtocolError(
                f"the engine gate refused {op!r}: {reply.error}", check="gate"
            )

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
