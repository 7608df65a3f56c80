"""The CPU option under which in-place refit of a running vLLM engine is exact: plain weights.

vLLM's CPU backend repacks weights after its dense load (``process_weights_after_loading``):
where a packed GEMM kernel is available, linear layers compute with a prepacked copy behind a
oneDNN / SGL / zentorch handle and their weight becomes an empty parameter, the output head
packs a copy of the embedding table, and the MoE experts are padded and prepacked into the
CPU kernel's layout.  Writes into the parameters then no longer reach what the model computes
with, and :meth:`~dcr.adapters.loaders.vllm.VllmLoader.check_ready` refuses such a model.

The model loader registered here under the load format
:data:`~dcr.integrations.vllm.PLAIN_WEIGHTS`
(``load_format="dcr_plain"``) loads the checkpoint exactly like vLLM's default loader and keeps
every parameter the plain tensor that ``load_weights`` writes:

* linear layers take vLLM's own opt-out of the CPU GEMM dispatch (``_cpu_skip_gemm_dispatch``,
  which vLLM uses for MLA's ``kv_b_proj``) and compute with ``F.linear`` on their weight;
* embedding tables used as the output head compute with ``F.linear`` on the table;
* MoE experts skip the prepacking after loading and pad and prepack the plain expert weights
  inside every forward call, so the kernel always sees the current bits;
* FP8 linear layers with per-channel scales (compressed-tensors, ``dcr fp8 export --block
  channel``) keep the ``[out, in]`` float8 weight and the scales their loaders wrote -- the
  weight processing would replace the weight by a transposed view of the same storage, which
  carries no weight loader -- and their kernel reads that transposed view per call.

Outputs are those of the same kernels on the same bits, so an engine refitted in place and an
engine started fresh on the new checkpoint, both under this option, agree bit for bit.  It
costs speed (no prepacked GEMM, MoE weights packed per call): it is meant for CPU engines
that take refits -- development, tests, CI.  GPU engines keep the plain layout for unquantized
weights and need no option; there the load format only adds these no-op markers.

This module imports vLLM; the worker extension imports it, so every worker process knows the
load format before it loads its model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from dcr.adapters.loaders.vllm import PLAIN_EXPERTS
from dcr.integrations.vllm import PLAIN_WEIGHTS

__all__ = ["PlainWeightsLoader"]


@register_model_loader(PLAIN_WEIGHTS)
class PlainWeightsLoader(DefaultModelLoader):  # type: ignore[misc]
    """vLLM's default loader (checkpoint files as ``load_format="auto"`` finds them) that
    keeps the loaded weights as the tensors the model computes with."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
        super().load_weights(model, model_config)
        # Runs after the dense load, before the weight processing these markers steer.
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedLinearMethod):
                module._cpu_skip_gemm_dispatch = True  # type: ignore[assignment]
            elif isinstance(method, UnquantizedFusedMoEMethod):
                _pack_experts_per_call(method)
            elif _is_fp8_channel(module):
                _keep_fp8_plain(module)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = super().load_model(vllm_config, model_config, prefix)
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )

        for module in model.modules():
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                # The output head reads the table itself, not a packed copy of it.
                module.cpu_linear = torch.nn.functional.linear
        return model


def _is_fp8_channel(module: torch.nn.Module) -> bool:
    """A compressed-tensors FP8 linear layer with per-channel weight scales."""
    scheme = getattr(module, "scheme", None)
    if type(scheme).__name__ != "CompressedTensorsW8A8Fp8":
        return False
    return str(getattr(scheme, "strategy", "")).lower().endswith("channel")


class _TransposedWeight:
    """A layer as an FP8 channel kernel reads it after weight processing: ``weight`` as the
    ``[in, out]`` (transposed) view of the layer's own ``[out, in]`` weight, every other
    attribute the layer's."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self._layer = layer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._layer, name)
        return value.t() if name == "weight" else value


def _keep_fp8_plain(layer: Any) -> None:
    """Run the layer's weight processing, then give it back the parameters its loaders wrote
    (same storage: the processing only re-wraps them), and let the kernel read the weight
    transposed per call."""
    scheme = layer.scheme
    process, apply = scheme.process_weights_after_loading, scheme.apply_weights

    def process_plain(layer: Any) -> None:
        weight, scale = layer.weight, layer.weight_scale
        process(layer)
        same = (layer.weight.data_ptr(), layer.weight_scale.data_ptr()) == (
            weight.data_ptr(), scale.data_ptr(),
        )  # fmt: skip
        if same:  # otherwise the processing moved the bits: check_ready refuses the model
            layer.weight, layer.weight_scale = weight, scale
            layer._dcr_plain_fp8 = True

    def apply_plain(layer: Any, x: torch.Tensor, bias: Any = None) -> Any:
        if getattr(layer, "_dcr_plain_fp8", False):
            return apply(_TransposedWeight(layer), x, bias)
        return apply(layer, x, bias)

    scheme.process_weights_after_loading = process_plain
    scheme.apply_weights = apply_plain


def _pack_experts_per_call(method: Any) -> None:
    """Make the CPU expert kernel that ``method`` builds pack the plain weights per call.

    The kernel is built during the weight processing (``_init_moe_kernel``); right after,
    its own processing (padding and prepacking the layer's weights) is replaced by nothing,
    and its ``apply`` pads and prepacks the weights it is given into temporaries first.
    Kernels of other devices (no ``isa``) are left alone.
    """
    build = method._init_moe_kernel

    def build_plain(layer: torch.nn.Module) -> None:
        build(layer)
        experts = method.moe_kernel.fused_experts
        if not hasattr(experts, "isa"):
            return
        from vllm._custom_ops import cpu_prepack_moe_weight

        apply = type(experts).apply

        def keep_plain(layer: torch.nn.Module) -> None:
            return None

        def apply_packed(
            output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
            w2: torch.Tensor, *args: Any, **kwargs: Any,
        ) -> None:  # fmt: skip
            scratch = torch.nn.Module()
            scratch.w13_weight = torch.nn.Parameter(w1, requires_grad=False)
            scratch.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
            experts._pad_moe_intermediate(scratch)  # new tensors when padding is needed
            packed_w1 = cpu_prepack_moe_weight(scratch.w13_weight, experts.isa)
            packed_w2 = cpu_prepack_moe_weight(scratch.w2_weight, experts.isa)
            apply(experts, output, hidden_states, packed_w1, packed_w2, *args, **kwargs)

        experts.process_weights_after_loading = keep_plain
        experts.apply = apply_packed
        setattr(experts, PLAIN_EXPERTS, True)

    method._init_moe_kernel = build_plain
