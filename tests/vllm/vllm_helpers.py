"""Helpers shared by the vLLM tests: checkpoints, storage snapshots, bit comparisons, write
traces."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr.tensors.bits import bits


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A tiny checkpoint on disk with the tensors it holds."""

    family: str
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    path: Path


def storage_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (tied names included)."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def snapshot(model: torch.nn.Module) -> dict[str, npt.NDArray[Any]]:
    """Copies of the stored bits of every parameter and buffer."""
    return {name: bits(t).copy() for name, t in storage_items(model)}


def bit_mismatches(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Names whose dtype, shape or any stored bit differ between the two models (both ways)."""
    mine = dict(storage_items(model))
    ref = dict(storage_items(reference))
    bad = sorted(set(mine) ^ set(ref))
    for name in sorted(set(mine) & set(ref)):
        a, b = mine[name], ref[name]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(bits(a), bits(b)):
            bad.append(name)
    return bad


def snapshot_mismatches(model: torch.nn.Module, snap: dict[str, npt.NDArray[Any]]) -> list[str]:
    """Names whose stored bits differ from ``snap``."""
    now = dict(storage_items(model))
    bad = sorted(set(now) ^ set(snap))
    for name in sorted(set(now) & set(snap)):
        if bits(now[name]).shape != snap[name].shape or not np.array_equal(
            bits(now[name]), snap[name]
        ):
            bad.append(name)
    return bad


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One mutating op the loader issued: op name, destination parameter and slice, source."""

    op: str
    dst: str
    dst_offset: int
    dst_shape: tuple[int, ...]
    dst_dtype: torch.dtype
    src_ptr: int | None
    src_dtype: torch.dtype | None


class WriteTrace(TorchDispatchMode):
    """Records every in-place op whose destination lies in one of the model's storages."""

    def __init__(self, storages: dict[int, str]) -> None:
        super().__init__()
        self.storages = storages
        self.writes: list[Write] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            dst = args[0]
            owner = self.storages.get(dst.untyped_storage().data_ptr())
            if owner is not None:
                src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
                self.writes.append(
                    Write(
                        op=str(func.overloadpacket.__name__),
                        dst=owner,
                        dst_offset=int(dst.storage_offset()),
                        dst_shape=tuple(dst.shape),
                        dst_dtype=dst.dtype,
                        src_ptr=None if src is None else src.untyped_storage().data_ptr(),
                        src_dtype=None if src is None else src.dtype,
                    )
                )
        return func(*args, **kwargs)


def trace_writes(model: torch.nn.Module, run: Callable[[], object]) -> list[Write]:
    """Run ``run()`` and return the writes it made into ``model``'s parameters and buffers."""
    storages: dict[int, str] = {}
    for name, t in storage_items(model):
        storages.setdefault(t.untyped_storage().data_ptr(), name)
    trace = WriteTrace(storages)
    with torch.no_grad(), trace:
        run()
    return trace.writes


# --- the CPU engine's post-load weight processing ------------------------------------------------
#
# What ``process_weights_after_loading`` repacks on CPU depends on the machine: with a packed GEMM
# kernel (oneDNN, SGL, zentorch) linear weights move behind a handle, otherwise they stay plain
# ``F.linear`` weights; MoE experts are prepacked by every CPU kernel.  Tests therefore observe
# what the processing did instead of assuming it: a module's own parameters replaced, reshaped,
# recast, moved or emptied, or a linear whose output no longer follows in-place writes to its
# weight parameter.


def run_cpu_engine_processing(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Run on ``model`` what vLLM's CPU engine runs once after its dense load."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    engine_config = EngineArgs(
        model=str(checkpoint_dir),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
    ).create_engine_config()
    process_weights_after_loading(model, engine_config.model_config, torch.device("cpu"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamState:
    """A parameter object and where and how its data lies."""

    param: torch.Tensor
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, p: torch.Tensor) -> ParamState:
        return cls(
            param=p,
            storage=p.untyped_storage().data_ptr(),
            offset=int(p.storage_offset()),
            shape=tuple(p.shape),
            stride=tuple(p.stride()),
            dtype=p.dtype,
        )

    def same_as(self, other: ParamState) -> bool:
        return self.param is other.param and (
            self.storage,
            self.offset,
            self.shape,
            self.stride,
            self.dtype,
        ) == (other.storage, other.offset, other.shape, other.stride, other.dtype)


def parameter_states(model: torch.nn.Module) -> dict[str, dict[str, ParamState]]:
    """Each module's own parameters (module names as ``named_modules`` gives them)."""
    return {
        name: {p_name: ParamState.of(p) for p_name, p in module.named_parameters(recurse=False)}
        for name, module in model.named_modules()
    }


def replaced_parameters(
    before: dict[str, dict[str, ParamState]], model: torch.nn.Module
) -> set[str]:
    """Modules whose own parameters changed since ``before``: another parameter object, storage,
    offset, shape, stride or dtype, a parameter added or removed, or an empty parameter."""
    changed = set()
    for name, now in parameter_states(model).items():
        old = before.get(name, {})
        if now.keys() != old.keys() or any(
            not state.same_as(old[p_name]) or state.param.numel() == 0
            for p_name, state in now.items()
        ):
            changed.add(name)
    return changed


def _linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: object) -> torch.Tensor:
    b = bias.float() if isinstance(bias, torch.Tensor) else None
    return torch.nn.functional.linear(x.float(), weight.float(), b)


def follows_weight_writes(module: torch.nn.Module) -> bool:
    """Whether the module's linear computation (its quant method's ``apply``, as in the forward
    pass) uses the current contents of its ``weight`` parameter.

    The weight is negated in place, the output compared with ``x W^T`` for the old and the new
    weight, and the weight restored.  Raises when the output matches neither.
    """
    weight = module.weight
    apply = module.quant_method.apply
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=generator).to(weight.dtype)
    bias = getattr(module, "bias", None)
    old_ref = _linear_reference(x, weight, bias)
    new_ref = _linear_reference(x, -weight.detach(), bias)
    saved = weight.detach().clone()
    with torch.no_grad():
        out_old = apply(module, x).float()
        weight.neg_()
        try:
            out_new = apply(module, x).float()
        finally:
            weight.copy_(saved)
    tolerance = 0.05 * float(old_ref.abs().max())
    assert float((out_old - old_ref).abs().max()) <= tolerance, "output is not x W^T"
    to_new = float((out_new - new_ref).abs().max())
    to_old = float((out_new - old_ref).abs().max())
    assert min(to_new, to_old) <= tolerance < float((new_ref - old_ref).abs().max()), (
        "after the write the output matches neither weight"
    )
    return to_new < to_old


def linear_like(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules that compute ``x W^T`` through a quant method with a non-empty 2-D weight
    (linears, the router, the embedding table as output projection)."""
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            callable(getattr(getattr(module, "quant_method", None), "apply", None))
            and isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and weight.numel() > 0
        ):
            out[name] = module
    return out


def observed_repacked(before: dict[str, dict[str, ParamState]], model: torch.nn.Module) -> set[str]:
    """The modules that processing since ``before`` repacked, by observation: parameters
    replaced (see :func:`replaced_parameters`) or a linear no longer computing with its weight
    parameter.  Only for a model whose linears are set up to compute (after the processing)."""
    stale = {name for name, m in linear_like(model).items() if not follows_weight_writes(m)}
    return replaced_parameters(before, model) | stale


def pack_like_the_cpu_engine(layer: torch.nn.Module, *, remove_weight: bool) -> None:
    """Do to ``layer`` what vLLM's CPU GEMM dispatch does on machines with a packed GEMM kernel:
    the kernel binds its own copy of the weight (here transposed, as oneDNN holds it) and the
    forward computes with that copy; for linear layers (``remove_weight``) the parameter is then
    replaced by an empty one, while embedding tables keep theirs for lookups."""
    packed = layer.weight.detach().t().contiguous()

    def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
        return torch.nn.functional.linear(x, packed.t(), bias)

    layer.cpu_linear = packed_linear
    if remove_weight:
        layer.weight = torch.nn.Parameter(
            torch.empty(0, dtype=packed.dtype, device=packed.device), requires_grad=False
        )


def pack_what_stayed_plain(model: torch.nn.Module) -> set[str]:
    """After the CPU engine's processing, pack every linear it left computing with its plain
    weight the way packed-GEMM machines do, so the model is in the fully repacked state on
    every CPU.  Returns the modules packed here."""
    from vllm.model_executor.layers.linear import LinearBase

    packed = set()
    for name, module in linear_like(model).items():
        if follows_weight_writes(module):
            pack_like_the_cpu_engine(module, remove_weight=isinstance(module, LinearBase))
            packed.add(name)
    return packed
