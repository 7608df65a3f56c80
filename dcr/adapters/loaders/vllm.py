"""vLLM's native loader as a dcr :class:`~dcr.apply.loader.Loader` (paper §6.1, App. A.2).

``vllm`` is imported only inside this module's functions; ``import dcr`` never pulls it in.

What ``model.load_weights`` does (vLLM 0.32, read from ``models/utils.py::AutoWeightsLoader``,
``layers/linear.py``, ``layers/vocab_parallel_embedding.py``,
``layers/fused_moe/routed_experts.py`` and traced with a dispatch mode on Qwen3, Qwen3-MoE and
Llama built in bfloat16):

* **Names.**  The model's ``hf_to_vllm_mapper`` renames checkpoint names: ``q_proj``/``k_proj``/
  ``v_proj`` -> ``qkv_proj`` (shard ``q``/``k``/``v``), ``gate_proj``/``up_proj`` ->
  ``gate_up_proj`` (shard 0/1), and the MoE layer routes ``mlp.experts.{j}.{gate,up,down}_proj``
  to ``mlp.experts.routed_experts.w13_weight``/``w2_weight`` of expert ``j``.  Every other name
  is kept.
* **Writes.**  Exactly one ``aten.copy_`` per checkpoint tensor whose source is the tensor that
  was passed in (same storage, shape and dtype when the model was built under its dtype) and
  whose destination is a contiguous slice of one parameter: a row range of the fused
  ``qkv_proj``/``gate_up_proj`` weight, ``w13_weight[j]`` rows ``[0, f)`` (gate) or ``[f, 2f)``
  (up), ``w2_weight[j]``, or the whole parameter.  ``embed_tokens``/``lm_head`` also issue
  ``fill_(0)`` on the vocabulary padding rows (``vocab_size`` is padded to a multiple of 64):
  a write that does not depend on the item, which a receiver classifies at prewarm.  A model
  built in float32 from a bf16 checkpoint casts in that copy: not bit-preserving, so receivers
  classify it as transforming (overwrite only).
* **Reported names** are vLLM parameter names (``...qkv_proj.weight``,
  ``...routed_experts.w13_weight``), a set: three checkpoint tensors report the same fused
  name, so reports cannot be mapped back to checkpoint names one to one.
* **Skips.**  An expert not local to this rank (expert parallelism) makes the expert weight
  loader return ``False``: no copy and no reported name, a native skip.  A tied ``lm_head``
  is the same ``Parameter`` as ``embed_tokens`` (``named_parameters(remove_duplicate=False)``
  lists both names); ``lm_head.weight`` in the input is dropped before any write, and loading it
  in a call that does not also load ``model.embed_tokens.weight`` raises.  Tied checkpoints
  have no ``lm_head.weight``, so a receiver never sees it.  In Qwen3-MoE ``mlp.gate`` and
  ``mlp.experts.gate`` are one module, so the router weight also has two parameter names.

Repacking.  The engine calls ``process_weights_after_loading`` once after its dense load.  What
the CPU backend does there depends on the CPU: where a packed GEMM kernel is available (e.g.
AVX-512 machines) it replaces dense linear weights by empty parameters and keeps a prepacked
copy behind a oneDNN (or SGL/zentorch) handle in ``layer.cpu_linear`` and packs the
``lm_head`` the same way while keeping the embedding table; elsewhere (e.g. AVX2-only AMD
EPYC) linears stay plain.  MoE expert weights are replaced by new parameters, padded
(intermediate size to a multiple of 32) and prepacked into the CPU kernel's layout.
In-place deltas written after that would miss or corrupt what the model computes with, so
:meth:`VllmLoader.check_ready` refuses such a model (the plain-weights load format of
:mod:`dcr.integrations.vllm.plain` keeps a CPU engine's weights plain).  The same step also
re-ties an ``lm_head`` that the config calls tied but the checkpoint carries, when the two are
equal.
GPU engines keep the plain layout for unquantized bf16 weights.  :func:`build_vllm_model`
builds the model class without the engine, so its weights stay plain.
"""

from __future__ import annotations

import os
import tempfile
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dcr.apply.loader import Loader
from dcr.errors import ConfigError, DcrError, LoaderPathUnsupported

__all__ = [
    "PLAIN_EXPERTS",
    "VllmLoader",
    "build_vllm_model",
    "find_repacked",
    "vllm_distributed",
]

PLAIN_EXPERTS = "dcr_plain_weights"
"""Attribute that marks a CPU MoE expert kernel packing the plain expert weights in every
call (set by the plain-weights load format), so its parameters are what it computes with."""

# Exceptions vLLM's loaders raise for names, shapes and shard ids they cannot place.
_VENDOR_ERRORS = (
    AssertionError,
    AttributeError,
    IndexError,
    KeyError,
    RuntimeError,
    TypeError,
    ValueError,
)


class VllmLoader(Loader):
    """A vLLM model (``*ForCausalLM`` instance) and its native ``load_weights``.

    The model must hold plain weights: built by :func:`build_vllm_model`, or taken from an engine
    whose weight processing keeps the loaded layout (see :meth:`check_ready`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        load = getattr(model, "load_weights", None)
        if not callable(load):
            raise ConfigError(
                f"{type(model).__name__} has no load_weights(); expected a vLLM model",
                check="loader",
            )
        self._model = model
        self._load: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[str] | None] = load

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None:
        """Run ``model.load_weights`` and return the vLLM parameter names it reports."""
        current: list[str] = []

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                current[:] = [name]
                yield name, tensor

        try:
            loaded = self._load(tracked())
        except DcrError:
            raise
        except _VENDOR_ERRORS as exc:
            detail = str(exc) or "no message"
            raise LoaderPathUnsupported(
                f"vLLM load_weights failed: {type(exc).__name__}: {detail}",
                tensor=current[0] if current else None,
                check="native-loader",
            ) from exc
        return None if loaded is None else {str(n) for n in loaded}

    def check_ready(self) -> None:
        """Raise :class:`~dcr.errors.LoaderPathUnsupported` when weights were repacked after
        loading (the CPU engine's ``process_weights_after_loading``), so in-place writes to the
        parameters would not reach what the model computes with."""
        repacked = find_repacked(self._model)
        if repacked:
            first, reason = next(iter(repacked.items()))
            more = f" (and {len(repacked) - 1} more modules)" if len(repacked) > 1 else ""
            raise LoaderPathUnsupported(
                f"module {first!r}: {reason}{more}; in-place refit cannot reach the weights the "
                "model computes with.  Build the model without the engine's post-load weight "
                "processing (build_vllm_model), or start the engine with "
                "load_format='dcr_plain' (dcr.integrations.vllm) to keep plain weights",
                check="repacked",
            )


def find_repacked(model: torch.nn.Module) -> dict[str, str]:
    """Modules whose compute weights are no longer their plain parameters, with the reason.

    Four signs, one per CPU repacking in vLLM's ``process_weights_after_loading``:

    * ``cpu_linear`` that captures state: the GEMM dispatch binds a oneDNN handle, SGL packed
      weight or zentorch weight in a closure; only ``F.linear`` itself or a closure-free
      function computes with the parameter that is passed in;
    * a linear-like module (one with a ``quant_method``) whose weight is an empty parameter
      (the dispatch drops the dense weight after packing it);
    * an FP8 linear layer whose weight is no longer the parameter its loader wrote (the FP8
      kernels' processing re-wraps it transposed, or packs it into the kernel's layout) --
      unless the plain-weights load format kept it;
    * an MoE module whose quant method has built its kernel (``moe_kernel``) on CPU weights:
      the CPU experts rewrite ``w13_weight``/``w2_weight`` into their packed layout when the
      kernel is set up -- unless the kernel carries :data:`PLAIN_EXPERTS` (the plain-weights
      load format of :mod:`dcr.integrations.vllm.plain` packs per call instead).
    """
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        cpu_linear = getattr(module, "cpu_linear", None)
        if cpu_linear is not None and not _is_plain_linear(cpu_linear):
            found[name] = "linear weight packed for the CPU GEMM kernel (cpu_linear holds a copy)"
            continue
        quant_method = getattr(module, "quant_method", None)
        if quant_method is None:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0:
            found[name] = "weight replaced by an empty parameter after loading"
            continue
        if (
            isinstance(weight, torch.Tensor)
            and weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and not hasattr(weight, "weight_loader")
        ):
            found[name] = "FP8 weight replaced after loading (transposed or packed for the kernel)"
            continue
        kernel = getattr(quant_method, "moe_kernel", None)
        if (
            kernel is not None
            and not getattr(getattr(kernel, "fused_experts", None), PLAIN_EXPERTS, False)
            and any(p.device.type == "cpu" for p in module.parameters(recurse=False))
        ):
            found[name] = "expert weights prepacked for the CPU MoE kernel"
    return found


def _is_plain_linear(fn: object) -> bool:
    if fn is torch.nn.functional.linear:
        return True
    return isinstance(fn, types.FunctionType) and fn.__closure__ is None


_dist_dir: tempfile.TemporaryDirectory[str] | None = None


def _ensure_distributed() -> bool:
    """Create vLLM's single-rank parallel groups (gloo, world 1, TP 1, PP 1) unless they exist.

    The groups are built under a config with no model, which makes vLLM create the expert
    parallel group as well, so dense and MoE models can share one state.  Returns whether
    this call created it.
    """
    global _dist_dir
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return False
    _dist_dir = tempfile.TemporaryDirectory(prefix="dcr-vllm-dist-")
    init_method = Path(_dist_dir.name, "store").as_uri()
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(1, 0, init_method, 0, backend="gloo")
            initialize_model_parallel(1, 1)
    except _VENDOR_ERRORS as exc:
        raise ConfigError(f"vLLM's distributed state could not be set up: {exc}") from exc
    return True


@contextmanager
def vllm_distributed() -> Iterator[None]:
    """vLLM's per-process distributed state for the duration of the block.

    vLLM model classes need its parallel groups, and a process holds one set of them.  The block
    creates single-rank groups if none exist (models built inside share them) and tears down on
    exit only what it created.  :func:`build_vllm_model` also creates them on first use, for
    the life of the process, when called outside such a block.
    """
    global _dist_dir
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    owned = _ensure_distributed()
    try:
        yield
    finally:
        if owned:
            destroy_model_parallel()
            destroy_distributed_environment()
            if _dist_dir is not None:
                _dist_dir.cleanup()
                _dist_dir = None


def build_vllm_model(
    checkpoint_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_model_len: int = 256,
) -> torch.nn.Module:
    """Build vLLM's model class for a Hugging Face checkpoint on CPU and dense-load it.

    No engine is started (a few seconds instead of a full engine start): the engine config is
    built with the tokenizer disabled and eager mode, the model class is instantiated under
    ``dtype`` on the CPU, and vLLM's default loader streams the checkpoint through
    ``model.load_weights`` -- the same dense load the engine does, with its check that every
    parameter was loaded.  ``process_weights_after_loading`` is not run, so the parameters stay
    the plain tensors the loader writes.  Each call builds an independent model; the process's
    distributed state (see :func:`vllm_distributed`) is created on first use.
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from dcr.tensors.bits import dtype_name

    path = os.fspath(checkpoint_dir)
    _ensure_distributed()
    try:
        vllm_config = EngineArgs(
            model=path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype=dtype_name(dtype),
            max_model_len=max_model_len,
        ).create_engine_config()
    except _VENDOR_ERRORS as exc:
        raise ConfigError(f"vLLM cannot configure a model from {path!r}: {exc}") from exc
    try:
        with set_current_vllm_config(vllm_config):
            with set_default_torch_dtype(dtype), torch.device("cpu"):
                model: torch.nn.Module = initialize_model(vllm_config=vllm_config)
            get_model_loader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
    except _VENDOR_ERRORS as exc:
        raise LoaderPathUnsupported(
            f"vLLM could not build and load {path!r}: {exc}", check="native-loader"
        ) from exc
    return model
