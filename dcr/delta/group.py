"""The training side of one process: every owner of a plan plus residual coordination.

On a real cluster each owner is its own rank and the residual steps use the trainer's process
group: change flags are all-reduced (OR) and converted parts gathered on the residual owner.
:class:`LocalTrainingGroup` runs all owners of a plan in one process and performs those two
collective steps in memory, which is what tests, demos, benchmarks and single-node trainers
need.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping
from functools import partial

import torch

from dcr.delta.layout import TrainingPlan
from dcr.delta.owner import Bucket, BuildConfig, BuildStats, Owner, ResidualJob
from dcr.delta.records import Mode, TensorSpec
from dcr.delta.residual import ResidualTask, assemble, required_tensors
from dcr.errors import ConfigError

__all__ = ["LocalTrainingGroup"]


class LocalTrainingGroup:
    """All owners of ``plan`` in this process, initialised at the committed shards ``base``.

    ``full_conversion=True`` additionally keeps a canonical baseline of every tensor so that
    :meth:`build` can run the full-conversion mode (F) used by benchmarks.
    """

    def __init__(
        self,
        plan: TrainingPlan,
        base: Mapping[str, torch.Tensor],
        *,
        config: BuildConfig | None = None,
        full_conversion: bool = False,
    ) -> None:
        plan.check_shards(base)
        self.plan = plan
        self.config = config or BuildConfig()
        ranks = range(plan.layout.world_size)
        self.owners: dict[int, Owner] = {r: Owner(r, plan, base, config=self.config) for r in ranks}
        self.full_conversion = full_conversion
        self._candidate: Mapping[str, torch.Tensor] | None = None
        for task in plan.residual:
            self.owners[plan.residual_owner(task.name)].set_residual_baseline(
                task.name, self._convert(task, base)
            )
        if full_conversion:
            for name in plan.catalog:
                self.owners[plan.residual_owner(name)].set_residual_baseline(
                    name, self._export(name, base)
                )

    @property
    def catalog(self) -> Mapping[str, TensorSpec]:
        return self.plan.catalog

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

    @property
    def staged(self) -> Mapping[str, torch.Tensor] | None:
        """The candidate shards of the next version, if staged."""
        return self._candidate

    def export(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical tensors of a version given its shards (full conversion of every tensor).

        Used to restore a receiver by dense refit from the training side's own baseline.
        """
        residual = {task.name: task for task in self.plan.residual}
        return {
            name: self._convert(residual[name], shards)
            if name in residual
            else self._export(name, shards)
            for name in self.plan.catalog
        }

    def stage(self, candidate: Mapping[str, torch.Tensor]) -> None:
        """Hand every owner its candidate shards for the next version."""
        self.plan.check_shards(candidate)
        for owner in self.owners.values():
            owner.stage(candidate)
        self._candidate = candidate

    def build(
        self, *, mode: Mode, xor_allowed: Container[str], full_conversion: bool = False
    ) -> dict[int, tuple[Iterator[Bucket], BuildStats]]:
        """Per owner: a lazy bucket iterator and the stats it fills while it runs.

        Runs the residual flag all-reduce first (it is cheap: only residual inputs are
        compared), so each residual owner knows the required tensor set before it starts.
        ``full_conversion`` runs mode F: no projection, every canonical tensor is exported
        and compared with the canonical baseline, overwrite records only.
        """
        cand = self._candidate
        if cand is None:
            raise ConfigError("stage() a candidate before build()")
        jobs: dict[int, list[ResidualJob]] = {r: [] for r in self.owners}
        if full_conversion:
            if not self.full_conversion:
                raise ConfigError("full conversion needs LocalTrainingGroup(full_conversion=True)")
            for name, spec in self.plan.catalog.items():
                jobs[self.plan.residual_owner(name)].append(
                    ResidualJob(spec=spec, candidate=partial(self._export, name, cand))
                )
            mode = Mode.OVERWRITE
        else:
            flagged = frozenset().union(*(o.flags() for o in self.owners.values()))
            for task in required_tensors(self.plan.residual, flagged):
                jobs[self.plan.residual_owner(task.name)].append(
                    ResidualJob(spec=task.spec, candidate=partial(self._convert, task, cand))
                )
        out = {}
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

    def commit(self) -> None:
        """Every owner updates its trackers and residual baseline in place."""
        for owner in self.owners.values():
            owner.commit()
        self._candidate = None

    def discard(self) -> None:
        for owner in self.owners.values():
            owner.discard()
        self._candidate = None
