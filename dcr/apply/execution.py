"""Execution of a payload's planned writes: stages of chunks spread over a pool of cores.

The plans of one payload (:mod:`dcr.apply.writes`), all built and checked before the first
write (deferred writes, paper App. A.2), are grouped into stages of pairwise disjoint
destinations; :class:`Execution` performs each stage's fused read-modify-write chunks
(:mod:`dcr.apply.rmw`) on up to ``threads`` cores, the C kernels' chunks without the GIL,
while the caller goes on admitting and planning the next payload.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dcr import native
from dcr.apply.call import Fail
from dcr.apply.rmw import run_chunk
from dcr.apply.writes import CHUNK, WritePlan
from dcr.tensors.parallel import default_threads as usable_cpus
from dcr.tensors.records import Encoding

__all__ = ["Execution", "Stage", "default_threads", "execute"]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def default_threads() -> int:
    """Cores one apply uses by default: the CPUs this process may run on (its affinity
    mask), at most 8."""
    return min(usable_cpus(), 8)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=max(1, usable_cpus() - 1), thread_name_prefix="dcr-apply"
            )
        return _POOL


Stage = Sequence[tuple[WritePlan, Encoding]]
"""Plans whose destinations are pairwise disjoint: their chunks may run in any order."""


Task = tuple[WritePlan, Encoding, int, int]

_HANDOVER_S = 0.002
"""How long a new :class:`Execution` waits for a pool worker to take up its chunks."""


def _native_args(plan: WritePlan) -> tuple[tuple[Any, ...], int, int] | None:
    """The plan as one of :func:`rmw_tasks`'s plans with the range of its entries that may
    land, or ``None`` when it needs Python.

    A mapped plan's entries outside the span of its source view (another tensor-parallel
    rank's rows, say) land nowhere: they are left out by two binary searches instead of being
    mapped one by one in the kernel.
    """
    if plan.blocks is not None or plan.cast is not None or plan.words is None:
        return None
    if plan.entries is None:
        return (plan.words, plan.positions, plan.values, 0, 0, None), 0, plan.size
    listed = plan.entries.listed
    if listed is None or plan.imap is None:
        return None
    imap = plan.imap
    lo = int(np.searchsorted(listed, imap.src_offset, side="left"))
    hi = int(np.searchsorted(listed, imap.src_offset + imap.src_span, side="right"))
    dims = np.array(imap.dims, dtype=np.int64).reshape(-1)
    args = (plan.words, listed, plan.entries.values, imap.src_offset, imap.dst_offset, dims)
    return args, lo, max(lo, hi)


class _Stage:
    """One stage's chunks: a task list the C kernels share out without the GIL (where the
    kernels are built and the storage is in host memory), and the rest as Python tasks."""

    def __init__(self, stage: Stage) -> None:
        kernels = native.kernels
        self.tasks: deque[Task] = deque()
        self.native: list[tuple[Any, ...]] = []
        self.owners: list[WritePlan] = []
        firsts: list[int] = []
        ends: list[int] = []
        codes: list[int] = []
        for plan, encoding in stage:
            native_plan = _native_args(plan) if kernels is not None else None
            if native_plan is not None:
                args, first, end = native_plan
                self.native.append(args)
                self.owners.append(plan)
                firsts.append(first)
                ends.append(end)
                codes.append(int(encoding))
            else:
                self.tasks.extend(
                    (plan, encoding, a, min(a + plan.step, plan.size))
                    for a in range(0, plan.size, plan.step)
                )
        # Native plans are mapped or materialized: CHUNK entries per task, over the entries
        # that may land.
        begin = np.array(firsts, dtype=np.int64)
        end_of = np.array(ends, dtype=np.int64)
        counts = -(-(end_of - begin) // CHUNK)
        plan_of = np.repeat(np.arange(len(firsts), dtype=np.int64), counts)
        nth = np.arange(plan_of.size, dtype=np.int64) - np.repeat(
            np.cumsum(counts) - counts, counts
        )
        lo = begin[plan_of] + nth * CHUNK
        hi = np.minimum(lo + CHUNK, end_of[plan_of])
        self.rows = np.stack([plan_of, lo, hi, np.array(codes, dtype=np.int64)[plan_of]], axis=1)
        self.state = np.zeros(2 + 2 * len(self.native), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rows) + len(self.tasks)

    @property
    def shared(self) -> bool:
        """Whether the C task list may still have chunks to hand out."""
        return bool(len(self.rows)) and int(self.state[0]) < len(self.rows) and not self.state[1]

    def run_shared(self, check: bool) -> None:
        kernels = native.kernels
        assert kernels is not None
        kernels.rmw_tasks(self.native, self.rows, self.state, check)


class Execution:
    """Planned writes of one payload, under way on pool threads while the caller goes on.

    Stages run one after the other; the chunks of one stage are spread over ``threads``
    cores: ``threads - 1`` pool workers start at once, and the caller joins them in
    :meth:`finish`.  The chunks of C-kernel plans are shared out inside the kernels, without
    the GIL, so the workers keep writing while the caller checks and plans the next payload
    in Python.  With ``check`` (paper App. A.2 "Post-apply checks") every written position is
    re-read: undoing the XOR mask or ULP delta must restore the saved pre-write bits, and an
    overwrite must hold the planned bits.  A failed check stops before the next stage;
    :meth:`finish` raises ``fail(..., "post-apply")``.
    """

    def __init__(
        self, stages: Sequence[Stage], *, check: bool, fail: Fail, threads: int | None = None
    ) -> None:
        self._check = check
        self._fail = fail
        self._stages: deque[_Stage] = deque(_Stage(stage) for stage in stages)
        self.written: dict[WritePlan, int] = {plan: 0 for stage in stages for plan, _ in stage}
        self._bad: dict[str, int] = {}
        self._busy = 0
        self._stop = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._joined = threading.Event()
        tasks = max((len(stage) for stage in self._stages), default=0)
        helpers = min(threads or default_threads(), tasks) - 1
        self._helpers: list[Future[None]] = [_pool().submit(self._work) for _ in range(helpers)]
        if self._helpers:
            # Hand the GIL over until a worker is inside the kernels (or briefly, when the
            # pool is busy elsewhere): a caller that goes on in Python would hold it for up to
            # the interpreter's switch interval.
            self._joined.wait(_HANDOVER_S)

    def _next(self) -> _Stage | Task | None:
        """What to do next: the current stage's shared C tasks, one Python chunk, or ``None``
        when every stage is done (or stopped)."""
        with self._cond:
            while not self._stop:
                stage = self._stages[0] if self._stages else None
                if stage is None:
                    return None
                if stage.shared:
                    self._busy += 1
                    return stage
                if stage.tasks:
                    self._busy += 1
                    return stage.tasks.popleft()
                if self._busy:  # the stage's last chunks are still being written
                    self._cond.wait()
                    continue
                self._close(self._stages.popleft())
                self._cond.notify_all()
            return None

    def _close(self, stage: _Stage) -> None:
        """Count a finished stage's C-kernel writes; a failed check stops the next stages."""
        n = len(stage.owners)
        for i, plan in enumerate(stage.owners):
            self.written[plan] += int(stage.state[2 + i])
            wrong = int(stage.state[2 + n + i])
            if wrong:
                self._bad[plan.label] = self._bad.get(plan.label, 0) + wrong
        self._stop = bool(self._bad)

    def _work(self) -> None:
        with torch.no_grad():
            while (job := self._next()) is not None:
                n = wrong = 0
                self._joined.set()
                try:
                    if isinstance(job, _Stage):
                        job.run_shared(self._check)
                    else:
                        plan, encoding, a, b = job
                        n, wrong = run_chunk(plan, encoding, a, b, self._check)
                except BaseException as exc:
                    with self._cond:
                        self._error = self._error or exc
                        self._stop = True
                        self._busy -= 1
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._busy -= 1
                    if not isinstance(job, _Stage):
                        self.written[job[0]] += n
                        if wrong:
                            self._bad[job[0].label] = self._bad.get(job[0].label, 0) + wrong
                    self._cond.notify_all()

    def finish(self) -> dict[WritePlan, int]:
        """Join the workers until every write has landed; returns the positions written per
        plan (raises the first failure)."""
        try:
            self._work()
        finally:
            for f in self._helpers:
                f.result()
        if self._error is not None:
            raise self._error
        if self._bad:
            label, count = next(iter(self._bad.items()))
            raise self._fail(
                f"{count} written positions of {label!r} do not hold the expected bits",
                "post-apply",
            )
        return self.written


def execute(
    stages: Sequence[Stage], *, check: bool, fail: Fail, threads: int | None = None
) -> dict[WritePlan, int]:
    """Perform the planned writes now (:class:`Execution`); returns the positions written per
    plan."""
    return Execution(stages, check=check, fail=fail, threads=threads).finish()
