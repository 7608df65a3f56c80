"""The training side as the owner engine sees it: a :class:`TrainingGroup` of owners.

A training group hosts one or more owner ranks of a :class:`~dcr.delta.layout.TrainingPlan`
and runs the two residual steps that span ranks (paper §4.3, App. A.1): change flags are
OR-reduced over owners and converted parts are gathered on each residual tensor's residual
owner.  :class:`LocalTrainingGroup` hosts every owner of a plan in one process and does those
steps in memory (tests, demos, benchmarks, single-node trainers);
:class:`~dcr.delta.dist.DistTrainingGroup` hosts one rank per trainer process and does them
through ``torch.distributed``.

What a group does per transition: :meth:`~TrainingGroup.stage` the candidate shards,
:meth:`~TrainingGroup.build` each attempt's buckets (any number of attempts, from the same
candidate and baseline), then :meth:`~TrainingGroup.commit` or
:meth:`~TrainingGroup.discard`.  :meth:`~TrainingGroup.build_dense` restores a joining
receiver from the committed baseline at any time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterator, Mapping
from functools import partial

import torch

from dcr.delta.build import Bucket, BuildConfig, BuildStats, ResidualJob
from dcr.delta.fp8_shared import shared_partials
from dcr.delta.layout import TrainingPlan
from dcr.delta.owner import Owner
from dcr.delta.residual import ResidualTask, assemble, required_tensors
from dcr.errors import ConfigError, DcrError
from dcr.tensors.records import Mode, TensorSpec

__all__ = ["BucketStreams", "LocalTrainingGroup", "TrainingGroup"]

BucketStreams = dict[int, tuple[Iterator[Bucket], BuildStats]]
"""Per hosted owner rank: a lazy bucket iterator and the stats it fills while it runs."""


class TrainingGroup(ABC):
    """Owner ranks of ``plan`` hosted in this process, plus the residual steps across ranks.

    :meth:`stage` may be collective (every process of the trainer calls it, in the same order,
    like an optimizer step); :meth:`build`, :meth:`build_dense`, :meth:`commit` and
    :meth:`discard` are local to this process, so the lazy bucket iterators never enter a
    collective and each owner engine may drive them on its own schedule.
    """

    def __init__(self, plan: TrainingPlan, config: BuildConfig | None) -> None:
        self.plan = plan
        self._wire: Mapping[str, TensorSpec] | None = None
        self.config = config or BuildConfig()
        self.owners: dict[int, Owner] = {}
        self._candidate: Mapping[str, torch.Tensor] | None = None
        # Per hosted rank: the residual jobs of the staged candidate (its required tensors).
        self._jobs: dict[int, list[ResidualJob]] = {}
        # FP8 tiles several owners share (dcr.delta.fp8_shared), and the staged candidate's
        # maxima of them over every owner (exchanged at staging).
        self._shared = plan.fp8_shared_tiles()
        self._next_amax: torch.Tensor | None = None

    @property
    def catalog(self) -> Mapping[str, TensorSpec]:
        """What receivers hold (:attr:`TrainingPlan.wire_catalog`): the canonical catalog, or
        with an FP8 rollout its FP8 values and scales in place of the quantized weights."""
        if self._wire is None:
            self._wire = self.plan.wire_catalog
        return self._wire

    @property
    def ranks(self) -> tuple[int, ...]:
        """Owner ranks hosted in this process, ascending."""
        return tuple(sorted(self.owners))

    @property
    def staged(self) -> Mapping[str, torch.Tensor] | None:
        """The candidate shards of the next version held by this process, if staged."""
        return self._candidate

    @property
    def failure(self) -> DcrError | None:
        """Why the group is broken (a collective failed), or ``None`` while it is healthy."""
        return None

    def check(self) -> None:
        """Raise :attr:`failure` if the group is broken."""
        failure = self.failure
        if failure is not None:
            raise failure

    def owner(self, rank: int) -> Owner:
        """The hosted owner of ``rank``; :class:`ConfigError` if this process does not host it."""
        owner = self.owners.get(rank)
        if owner is None:
            raise ConfigError(f"owner rank {rank} is not hosted here (hosted: {self.ranks})")
        return owner

    @abstractmethod
    def stage(self, candidate: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Hand the hosted owners their candidate shards of the next version.

        ``candidate`` holds (at least) the shards this process holds.  ``donate=True``: the
        owners keep the candidate's tensors as their baseline at commit instead of copying
        them, and the caller must not write them again (:meth:`Owner.stage`).
        """

    @abstractmethod
    def build(self, *, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
        """Per hosted owner: the buckets of one attempt for the staged candidate.

        ``xor_allowed`` names the canonical tensors mixed mode may XOR-encode.  Every owner's
        iterator ends with exactly one ``final`` bucket.
        """

    def build_dense(self) -> BucketStreams:
        """Per hosted owner: every element it is responsible for at the committed version.

        For a receiver that starts, restarts or fell behind (see :meth:`Owner.build_dense`);
        the union over all owners of the plan is the whole committed checkpoint.
        """
        self.check()
        out: BucketStreams = {}
        for rank in self.ranks:
            stats = BuildStats()
            out[rank] = (self.owners[rank].build_dense(stats=stats), stats)
        return out

    def commit(self, rank: int | None = None) -> None:
        """Move trackers and residual baseline to the staged candidate, in place.

        ``rank`` commits one hosted owner (the owner engine calls it per rank once the commit
        record names the new version); ``None`` commits every hosted owner and releases the
        candidate.  Repeatable, like :meth:`Owner.commit`.
        """
        if rank is not None:
            self.owner(rank).commit(residual=self._jobs.get(rank, ()))
            return
        for r, owner in self.owners.items():
            owner.commit(residual=self._jobs.get(r, ()))
        self._unstage()

    def discard(self) -> None:
        """Drop the staged candidate (transition aborted); the baseline is unchanged."""
        for owner in self.owners.values():
            owner.discard()
        self._unstage()

    def _unstage(self) -> None:
        self._candidate = None
        self._jobs = {}
        self._next_amax = None


class LocalTrainingGroup(TrainingGroup):
    """All owners of ``plan`` in this process, initialised at the committed shards ``base``.

    The residual steps run in memory: :meth:`stage` takes the union of the owners' change
    flags, and each required tensor's parts are converted when its residual owner's iterator
    reaches it.  ``full_conversion=True`` additionally
    keeps a canonical baseline of every tensor so that :meth:`build` can run the
    full-conversion mode (F) used by benchmarks.
    """

    def __init__(
        self,
        plan: TrainingPlan,
        base: Mapping[str, torch.Tensor],
        *,
        config: BuildConfig | None = None,
        full_conversion: bool = False,
    ) -> None:
        super().__init__(plan, config)
        plan.check_shards(base)
        self.full_conversion = full_conversion
        amax = self._shared_amax(base)
        self.owners = {r: self._fresh_owner(r, base, amax) for r in range(plan.layout.world_size)}

    def _shared_amax(self, shards: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The maxima of the shared FP8 tiles in ``shards`` (every owner's partials,
        maximised), or ``None`` without shared tiles."""
        if not self._shared:
            return None
        fp8 = self.plan.fp8
        assert fp8 is not None
        return self._shared.vector(shared_partials(fp8, self.plan.fp8_regions(r), shards)
                                 for r in self.plan.owners)  # fmt: skip

    def _fresh_owner(
        self, rank: int, base: Mapping[str, torch.Tensor], amax: torch.Tensor | None
    ) -> Owner:
        """Owner ``rank`` at the committed shards ``base``, with its residual baseline (and
        ``amax``, the committed maxima of the shared FP8 tiles)."""
        rows = None
        if amax is not None:
            regions = [region for region, _ in self.plan.fp8_regions(rank).values()]
            rows = self._shared.tiles(amax, regions)
        owner = Owner(rank, self.plan, base, config=self.config, fp8_amax=rows)
        for task in self.plan.residual:
            if self.plan.residual_owner(task.name) == rank:
                owner.set_residual_baseline(task.name, self._convert(task, base))
        if self.full_conversion:
            for name in self.plan.catalog:
                if self.plan.residual_owner(name) == rank:
                    owner.set_residual_baseline(name, self._canonical(name, base))
        return owner

    def restart(self, rank: int, committed: Mapping[str, torch.Tensor]) -> Owner:
        """Replace owner ``rank`` by a fresh one, as when its process restarts.

        Trackers and residual baseline come from the ``committed`` shards (paper App. B.2: a
        restarted endpoint resumes at the committed version); the staged candidate, if any,
        is handed to it so it can join the running transition.
        """
        self.plan.check_shards(committed)
        owner = self._fresh_owner(rank, committed, self._shared_amax(committed))
        if self._candidate is not None:
            owner.stage(self._candidate)
            if self._next_amax is not None:
                owner.fp8_share(self._shared, self._next_amax)
        self.owners[rank] = owner
        return owner

    def _convert(self, task: ResidualTask, shards: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Convert the parts of ``task`` on their owners; assemble it on its residual owner."""
        converted = {i: p.convert([shards[k] for k in p.inputs]) for i, p in enumerate(task.parts)}
        return assemble(task, converted)

    def _export(self, name: str, shards: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Full conversion of one canonical tensor from the shards that project into it."""
        spec = self.plan.catalog[name]
        out = torch.empty(spec.shape, dtype=spec.dtype)
        for s in self.plan.shards:
            if s.mapping is None or name not in s.mapping.names:
                continue
            views = {
                n: out
                if n == name
                else torch.empty(
                    self.plan.catalog[n].shape, dtype=self.plan.catalog[n].dtype, device="meta"
                )
                for n in s.mapping.names
            }
            for n, canon, local in s.mapping.blocks(views, shards[s.key]):
                if n == name:
                    canon.copy_(local)
        return out

    def _canonical(self, name: str, shards: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One canonical tensor of a version: residual conversion or full conversion."""
        for task in self.plan.residual:
            if task.name == name:
                return self._convert(task, shards)
        return self._export(name, shards)

    def export(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical tensors of a version given its shards (full conversion of every tensor).

        Used to restore a receiver by dense refit from the training side's own baseline.
        """
        return {name: self._canonical(name, shards) for name in self.plan.catalog}

    def stage(self, candidate: Mapping[str, torch.Tensor], *, donate: bool = False) -> None:
        """Hand every owner its candidate shards; select the required residual tensors.

        The flag OR-reduce is cheap (only residual inputs are compared) and its result holds
        for every attempt of the transition, so each residual owner knows its jobs up front.
        """
        self.plan.check_shards(candidate)
        for owner in self.owners.values():
            owner.stage(candidate, donate=donate)
        self._candidate = candidate
        if self._shared:  # the shared FP8 tiles' maxima over every owner
            owners = self.owners.values()
            self._next_amax = self._shared.vector(o.fp8_partials(candidate) for o in owners)
            for owner in owners:
                owner.fp8_share(self._shared, self._next_amax)
        flagged = frozenset().union(*(o.flags() for o in self.owners.values()))
        jobs: dict[int, list[ResidualJob]] = {r: [] for r in self.owners}
        for task in required_tensors(self.plan.residual, flagged):
            jobs[self.plan.residual_owner(task.name)].append(
                ResidualJob(spec=task.spec, candidate=partial(self._convert, task, candidate))
            )
        self._jobs = jobs

    def build(
        self, *, mode: Mode, xor_allowed: Container[str], full_conversion: bool = False
    ) -> BucketStreams:
        """Per owner: a lazy bucket iterator and the stats it fills while it runs.

        ``full_conversion`` runs mode F: no projection, every canonical tensor is exported
        and compared with the canonical baseline, overwrite records only.
        """
        cand = self._candidate
        if cand is None:
            raise ConfigError("stage() a candidate before build()")
        jobs = self._jobs
        if full_conversion:
            if not self.full_conversion:
                raise ConfigError("full conversion needs LocalTrainingGroup(full_conversion=True)")
            jobs = {r: [] for r in self.owners}
            for name, spec in self.plan.catalog.items():
                jobs[self.plan.residual_owner(name)].append(
                    ResidualJob(spec=spec, candidate=partial(self._canonical, name, cand))
                )
            mode = Mode.OVERWRITE
        out: BucketStreams = {}
        for rank, owner in self.owners.items():
            stats = BuildStats()
            it = owner.build(
                mode=mode,
                xor_allowed=xor_allowed,
                residual=jobs[rank],
                project=not full_conversion,
                stats=stats,
            )
            out[rank] = (it, stats)
        return out
