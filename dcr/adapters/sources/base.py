"""The source interface: what the training side hands dcr for each version."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from dcr.delta.layout import TrainingPlan
from dcr.tensors.records import TensorSpec

__all__ = ["ShardSource", "Source"]


class Source(ABC):
    """Training shards with their mapping metadata (a :class:`TrainingPlan`).

    ``base_shards()`` are the shards of the version receivers hold now; ``candidate_shards``
    turns whatever the trainer produced for the next version into shards of the same plan.
    """

    @property
    @abstractmethod
    def plan(self) -> TrainingPlan:
        """Shards, owners and mappings of the training layout."""

    @abstractmethod
    def base_shards(self) -> Mapping[str, torch.Tensor]:
        """Shard tensors (by shard key) of the version the receivers hold."""

    @abstractmethod
    def candidate_shards(self, update: Any) -> Mapping[str, torch.Tensor]:
        """Shard tensors (by shard key) of the next version, built from ``update``."""

    @property
    def catalog(self) -> Mapping[str, TensorSpec]:
        """Canonical names, shapes and dtypes; receivers learn them at prewarm."""
        return self.plan.catalog


class ShardSource(Source):
    """A source given directly as a plan and shard tensors (custom or residual layouts).

    ``candidate_shards`` takes a mapping of shard key to tensor.
    """

    def __init__(self, plan: TrainingPlan, shards: Mapping[str, torch.Tensor]) -> None:
        plan.check_shards(shards)
        self._plan = plan
        self._base = dict(shards)

    @property
    def plan(self) -> TrainingPlan:
        return self._plan

    def base_shards(self) -> Mapping[str, torch.Tensor]:
        return self._base

    def candidate_shards(self, update: Any) -> Mapping[str, torch.Tensor]:
        self._plan.check_shards(update)
        return dict(update)
