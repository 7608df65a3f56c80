"""A canonical (Hugging Face layout) state dict sliced into Megatron-style training shards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dcr.adapters.sources.base import Source
from dcr.delta.layout import TrainingPlan, TrainLayout, build_plan
from dcr.errors import ConfigError
from dcr.tensors.records import TensorSpec

__all__ = ["StateDictSource"]


class StateDictSource(Source):
    """Training shards made from canonical state dicts by the layout generator.

    ``layout`` gives TP / EP / DP; ``family`` (``None``, ``"llama"``, ``"qwen3"``,
    ``"qwen3_moe"``) and its HF-style ``config`` dict select Megatron's fused layouts.  This is
    the source for tests, demos and trainers that can produce a canonical state dict (FSDP
    after a full-state gather, single-GPU trainers).  A tied-embedding model's state dict may
    omit ``lm_head.weight``, as its checkpoints do.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        layout: TrainLayout | None = None,
        family: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if not state_dict:
            raise ConfigError("the state dict is empty")
        catalog = {n: TensorSpec.of(n, t) for n, t in state_dict.items()}
        for name, t in state_dict.items():
            if t.device.type != "cpu":
                raise ConfigError(f"tensors must be on the CPU, got {t.device}", tensor=name)
        self._plan = build_plan(catalog, layout or TrainLayout(), family=family, config=config)
        self._base = self._plan.slice(state_dict)

    @property
    def plan(self) -> TrainingPlan:
        return self._plan

    def base_shards(self) -> Mapping[str, torch.Tensor]:
        return self._base

    def candidate_shards(self, update: Any) -> Mapping[str, torch.Tensor]:
        if not isinstance(update, Mapping):
            raise ConfigError("StateDictSource takes a canonical state dict per version")
        extra = set(update) - set(self._plan.catalog)
        if extra:
            raise ConfigError(f"unknown tensors in the new state dict: {sorted(extra)[:5]}")
        return self._plan.slice(update)
