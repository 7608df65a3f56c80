"""dcr's loaders run the loader conformance suite: the ``load_state_dict``-style loader of a
plain torch module and the sharded sharded receiver (the vLLM loader runs it in
``tests/vllm/test_vllm_loader_suite.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply.loader import Loader
from dcr.models.families import canonical_shapes, tiny_config
from dcr.tensors.records import TensorSpec
from dcr.testing.loader import LoaderTests


class Tiny(torch.nn.Module):
    """Parameters of two dtypes, a tied pair, a float32 copy of a bf16 tensor (a cast: a
    transforming path) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))
        self.proj = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.zeros(8, dtype=torch.float32))
        self.head = self.embed  # tied: one Parameter under two names
        self.register_buffer("scale", torch.zeros(4, dtype=torch.float16))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


class TestTorchModuleLoader(LoaderTests):
    def make_loader(self) -> Loader:
        return TorchModuleLoader(Tiny())

    def catalog(self) -> Mapping[str, TensorSpec]:
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "embed": ((16, 8), torch.bfloat16),
            "proj": ((8, 8), torch.bfloat16),
            "norm": ((8,), torch.bfloat16),
            "head": ((16, 8), torch.bfloat16),
            "scale": ((4,), torch.float16),
            "steps": ((3,), torch.int64),
            "other_rank.weight": ((4,), torch.bfloat16),  # not in the module: a native skip
        }
        return {n: TensorSpec(name=n, shape=s, dtype=d) for n, (s, d) in shapes.items()}

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        weights = super().weights(seed)
        weights["head"] = weights["embed"].clone()  # a tied checkpoint: the same bits twice
        return weights


A_LOG = "model.layers.0.mixer.A_log"
EXTRA = {
    A_LOG: TensorSpec(name=A_LOG, shape=(8,), dtype=torch.bfloat16),
    "model.layers.0.mixer.dt_bias": TensorSpec(
        name="model.layers.0.mixer.dt_bias", shape=(8,), dtype=torch.bfloat16
    ),
}


class ReferenceSuite(LoaderTests):
    family = "qwen3"
    tp_size, tp_rank = 2, 1
    config: dict[str, Any] = tiny_config("qwen3")

    def make_loader(self) -> Loader:
        model = ShardedServingModel(
            self.config, self.family, tp_size=self.tp_size, tp_rank=self.tp_rank, extra=EXTRA
        )
        return ShardedServingLoader(model)

    def catalog(self) -> Mapping[str, TensorSpec]:
        shapes = canonical_shapes(self.config, self.family)
        out = {
            n: TensorSpec(name=n, shape=tuple(s), dtype=torch.bfloat16) for n, s in shapes.items()
        }
        return {**out, **EXTRA}


class TestReferenceLoaderQwen3(ReferenceSuite):
    """Fused q/k/v and gate/up, vocabulary padding, a cast norm and a computed ``A``."""


class TestReferenceLoaderMoe(ReferenceSuite):
    """Experts of another rank are native skips."""

    family = "qwen3_moe"
    tp_rank = 0
    config = tiny_config("qwen3_moe")
