"""vLLM's native loader runs the loader conformance suite: a tiny Qwen3 and a tiny Qwen3-MoE
model class built without the engine (plain weights), and a model whose linear the CPU GEMM
dispatch packed (refused)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from vllm_helpers import Checkpoint, linear_like, pack_like_the_cpu_engine

from dcr.adapters.loaders.vllm import VllmLoader
from dcr.apply.loader import Loader
from dcr.tensors.records import TensorSpec
from dcr.testing.loader import LoaderTests

pytestmark = pytest.mark.vllm


class VllmSuite(LoaderTests):
    family = "qwen3"

    @pytest.fixture(autouse=True)
    def _model(
        self,
        write_tiny: Callable[..., Checkpoint],
        build_model: Callable[[Path], torch.nn.Module],
    ) -> None:
        self.checkpoint = write_tiny(self.family)
        self.build = build_model

    def make_loader(self) -> Loader:
        return VllmLoader(self.build(self.checkpoint.path))

    def catalog(self) -> Mapping[str, TensorSpec]:
        return {n: TensorSpec.of(n, t) for n, t in self.checkpoint.state_dict.items()}

    def repack(self, loader: Loader) -> bool:
        name, layer = next(iter(linear_like(loader.module).items()))
        pack_like_the_cpu_engine(layer, remove_weight=not name.endswith("embed_tokens"))
        return True


class TestVllmLoaderQwen3(VllmSuite):
    """Fused q/k/v and gate/up, a tied embedding, vocabulary padding."""


class TestVllmLoaderQwen3Moe(VllmSuite):
    """Fused experts and a router with two parameter names."""

    family = "qwen3_moe"
