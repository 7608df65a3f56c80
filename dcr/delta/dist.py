"""A training group with one owner rank per trainer process, over ``torch.distributed``.

Each trainer process hosts the owner of its own training rank and holds only the shards whose
replicas include that rank.  The two residual steps run in the trainer's own process group
(paper §4.3, App. A.1, Fig. A.4), never in a group that spans the rollout side (G4):

* **change flags**: each rank flags the residual-input shards it owns whose stored bits
  changed; one ``all_reduce(MAX)`` over an integer vector indexed by the sorted residual input
  keys gives every rank the same flags, hence the same required tensor set;
* **residual gather**: each part of a required residual tensor is converted on the owner of
  its first input (which holds replicas of the other inputs) and sent point to point to the
  tensor's residual owner as raw bytes, so stored bits travel unchanged.  Shapes and dtypes
  come from the plan, so every buffer is preallocated, and all transfers follow one global
  order with one tag each: no rank can wait on a message that is never sent.

Both steps run in :meth:`DistTrainingGroup.stage` (and, for the residual baseline, in the
constructor), which every rank calls in lockstep like an optimizer step; they run once per
staged candidate because ``W^{v+1}`` and ``B^v`` stay fixed across the attempts of a
transition (App. A.1 "Fixed state").  Builds, dense builds and commits are local.

A collective that fails or times out (a peer died or hangs) raises :class:`DcrError` with
``check="training-group"`` and leaves the group broken: later calls raise the same error.  Its
collectives are then out of step, so the trainer must be restarted as a whole, every rank at
the committed version (as torchrun's elastic restart does); the fleet launcher does that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from dcr.delta.build import BuildConfig, BuildStats, ResidualJob
from dcr.delta.fp8 import Fp8Region
from dcr.delta.fp8_shared import shared_partials
from dcr.delta.group import BucketStreams, TrainingGroup
from dcr.delta.layout import ShardSpec, TrainingPlan
from dcr.delta.owner import Owner
from dcr.delta.residual import ResidualTask, assemble, required_tensors
from dcr.errors import ConfigError, DcrError, LayoutError
from dcr.tensors.records import Mode

__all__ = ["DistTrainingGroup", "ResidualExchange"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidualExchange:
    """What the residual steps of the last staging did on this rank (for logs and tests)."""

    flagged: frozenset[str] = frozenset()
    """Residual input shards flagged by any rank (the OR-reduced change flags)."""
    required: tuple[str, ...] = ()
    """The required residual tensors ``U_req``, in plan order."""
    parts_sent: int = 0
    parts_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of ``t`` as a flat ``uint8`` tensor (bit-exact for every dtype)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class DistTrainingGroup(TrainingGroup):
    """Training rank ``rank`` of ``plan.layout``, one process among ``world_size``.

    ``shards`` are the committed shard tensors this rank holds: every shard whose ``replicas``
    include ``rank`` (extra keys are ignored, nothing else is kept).  ``group`` is the
    trainer's process group (default: the default group), whose rank numbering must match the
    plan's and which must move CPU tensors (gloo; create one with
    ``dist.new_group(backend="gloo")`` in an NCCL trainer).  Construction is collective: it
    gathers every residual tensor from the committed shards to initialise the residual
    baseline.  ``timeout_s`` bounds each collective step.
    """

    def __init__(
        self,
        plan: TrainingPlan,
        rank: int,
        shards: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        config: BuildConfig | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(plan, config)
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("DistTrainingGroup needs an initialised torch.distributed group")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        world = plan.layout.world_size
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if size != world or me != rank:
            raise ConfigError(
                f"process group rank {me} of {size} does not match training rank {rank} of {world}",
                check="training-group",
            )
        self.rank = rank
        self.group = group
        self.timeout_s = timeout_s
        self.held: tuple[ShardSpec, ...] = tuple(s for s in plan.shards if rank in s.replicas)
        self._inputs = tuple(sorted(plan.residual_inputs))
        self._check_converters()
        self._failure: DcrError | None = None
        self.exchange = ResidualExchange()
        """What the residual steps of the last :meth:`stage` did on this rank."""
        base = self._held(shards, "committed")
        amax = None
        if self._shared:  # the committed maxima of the shared FP8 tiles, over every rank
            assert plan.fp8 is not None
            mine = shared_partials(plan.fp8, plan.fp8_regions(rank), base)
            vector = self._step("fp8-amax-baseline", lambda: self._all_max(mine))
            amax = self._shared.tiles(vector, [r for r, _ in plan.fp8_regions(rank).values()])
        self.owners = {rank: Owner(rank, plan, base, config=self.config, fp8_amax=amax)}
        gathered, _ = self._step("residual-baseline", lambda: self._gather(plan.residual, base))
        for name, tensor in gathered.items():
            self.owners[rank].set_residual_baseline(name, tensor)

    @property
    def failure(self) -> DcrError | None:
        return self._failure

    # ------------------------------------------------------------------ version state

    def stage(self, candidate: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Stage this rank's candidate shards and run the residual steps (collective).

        Every rank calls it with its own candidate shards; it returns once the flags are
        OR-reduced and this rank's required residual tensors are assembled.
        """
        self.check()
        self._unstage()
        owner = self.owners[self.rank]
        t0 = time.perf_counter()

        def stage_held() -> dict[str, torch.Tensor]:
            held = self._held(candidate, "candidate")
            owner.stage(held, donate=donate)
            return held

        # Peers are entering the collectives: a rank that fails before them breaks the group.
        held = self._step("stage", stage_held)
        self._candidate = held
        if self._shared:  # the candidate's maxima of the shared FP8 tiles, over every rank
            mine = owner.fp8_partials(held)
            owner.fp8_share(self._shared, self._step("fp8-amax", lambda: self._all_max(mine)))
        flagged = self._step("residual-flags", lambda: self._flags(owner))
        required = required_tensors(self.plan.residual, flagged)
        assembled, moved = self._step("residual-gather", lambda: self._gather(required, held))
        self._jobs = {
            self.rank: [
                ResidualJob(spec=task.spec, candidate=_constant(assembled[task.name]))
                for task in required
                if task.name in assembled
            ]
        }
        self.exchange = replace(
            moved,
            flagged=flagged,
            required=tuple(task.name for task in required),
            seconds=time.perf_counter() - t0,
        )

    def build(self, *, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
        """This rank's buckets of one attempt (local: the residual steps ran in :meth:`stage`)."""
        self.check()
        if self._candidate is None:
            raise ConfigError("stage() a candidate before build()")
        stats = BuildStats()
        it = self.owners[self.rank].build(
            mode=mode, xor_allowed=xor_allowed, residual=self._jobs.get(self.rank, ()), stats=stats
        )
        return {self.rank: (it, stats)}

    # ------------------------------------------------------------------ residual steps

    def _held(self, shards: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
        """The shards this rank holds, checked against the plan."""
        out = {}
        for s in self.held:
            t = shards.get(s.key)
            if t is None:
                raise LayoutError(f"{what} shard of rank {self.rank} missing", tensor=s.key)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise LayoutError(
                    f"expected {s.dtype}{list(s.shape)}, got {t.dtype}{list(t.shape)}",
                    tensor=s.key,
                    check="shape",
                )
            out[s.key] = t.detach()
        return out

    def _check_converters(self) -> None:
        """Each part's converter (owner of its first input) must hold every input."""
        for task in self.plan.residual:
            for part in task.parts:
                converter = self.plan[part.inputs[0]].owner
                for key in part.inputs:
                    if converter not in self.plan[key].replicas:
                        raise LayoutError(
                            f"rank {converter} converts a part but holds no replica of {key!r}",
                            tensor=task.name,
                            check="residual-part",
                        )

    def _step(self, step: str, run: Callable[[], T]) -> T:
        """Run one collective step; any failure breaks the group (its collectives are out of
        step) and is reported as ``check="training-group"``."""
        try:
            return run()
        except DcrError as exc:
            self._failure = self._broken(step, exc.message)
            raise
        except Exception as exc:  # torch.distributed raises RuntimeError and subclasses
            self._failure = self._broken(step, str(exc))
            raise self._failure from exc

    def _broken(self, step: str, why: str) -> DcrError:
        return DcrError(
            f"training rank {self.rank}: {step} failed: {why}; the trainer's process group is "
            "broken, restart every rank of the trainer at the committed version",
            check="training-group",
        )

    def _waiter(self) -> Callable[[dist.Work], None]:
        """Waits on works against one deadline ``timeout_s`` from now."""
        end = time.monotonic() + self.timeout_s

        def wait(work: dist.Work) -> None:
            work.wait(timeout=timedelta(seconds=max(end - time.monotonic(), 1e-3)))

        return wait

    def _all_max(self, partials: Mapping[str, tuple[Fp8Region, torch.Tensor]]) -> torch.Tensor:
        """The shared FP8 tiles' maxima: this rank's ``partials`` in their slots, maximised
        element-wise over every rank (``all_reduce`` MAX of one ``float32`` per tile)."""
        vector = self._shared.vector([partials])
        wait = self._waiter()
        work = dist.all_reduce(vector, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        wait(work)
        return vector

    def _flags(self, owner: Owner) -> frozenset[str]:
        """OR-reduce the change flags over ranks (paper App. A.1 ``all_reduce_flags``)."""
        if not self._inputs:
            return frozenset()
        mine = owner.flags()
        flags = torch.tensor([key in mine for key in self._inputs], dtype=torch.int32)
        wait = self._waiter()
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        wait(work)
        return frozenset(k for k, f in zip(self._inputs, flags.tolist(), strict=True) if f)

    def _convert(
        self, task: ResidualTask, index: int, shards: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        part = task.parts[index]
        out = part.convert([shards[k] for k in part.inputs])
        if tuple(out.shape) != part.placement.source_shape or out.dtype != task.spec.dtype:
            raise LayoutError(
                f"converted part {index} is {out.dtype}{list(out.shape)}, expected "
                f"{task.spec.dtype}{list(part.placement.source_shape)}",
                tensor=task.name,
                check="residual-part",
            )
        return out

    def _gather(
        self, tasks: Sequence[ResidualTask], shards: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], ResidualExchange]:
        """Convert and gather the parts of ``tasks``; assemble those this rank owns.

        Every rank walks the same (task, part) order and gives transfer ``k`` tag ``k``.
        Returns the assembled tensors and the parts and bytes this rank moved.
        """
        parts: dict[str, dict[int, torch.Tensor]] = {}
        wait = self._waiter()
        works: list[dist.Work] = []
        sent = received = bytes_sent = bytes_received = 0
        tag = 0
        for task in tasks:
            dst = self.plan.residual_owner(task.name)
            if dst == self.rank:
                parts[task.name] = {}
            for i, part in enumerate(task.parts):
                tag += 1
                src = self.plan[part.inputs[0]].owner
                if self.rank == src:
                    converted = self._convert(task, i, shards)
                    if dst == self.rank:
                        parts[task.name][i] = converted
                        continue
                    raw = _raw(converted)
                    if raw.numel():
                        work = dist.isend(raw, group=self.group, group_dst=dst, tag=tag)
                        assert work is not None
                        works.append(work)
                    sent += 1
                    bytes_sent += raw.numel()
                elif self.rank == dst:
                    shape = part.placement.source_shape
                    size = task.spec.itemsize * int(torch.Size(shape).numel())
                    raw = torch.empty(size, dtype=torch.uint8)
                    if size:
                        work = dist.irecv(raw, group=self.group, group_src=src, tag=tag)
                        assert work is not None
                        works.append(work)
                    parts[task.name][i] = raw.view(task.spec.dtype).reshape(shape)
                    received += 1
                    bytes_received += size
        for work in works:
            wait(work)
        assembled = {
            task.name: assemble(task, parts[task.name]) for task in tasks if task.name in parts
        }
        return assembled, ResidualExchange(
            parts_sent=sent,
            parts_received=received,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A residual job's candidate that was assembled ahead of the build."""
    return lambda: t
