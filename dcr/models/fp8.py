"""FP8 rollout checkpoints of a BF16 model (``docs/fp8.md``).

The rollout checkpoint is a conversion of the canonical (trainer's) checkpoint: every linear
weight of attention and MLP blocks (``q/k/v/o_proj``, ``gate/up/down_proj``, the experts' too)
becomes ``float8_e4m3fn`` values and ``float32`` scales by :func:`dcr.tensors.fp8.quantize`;
norms, embeddings, the LM head and MoE routers (``mlp.gate``) stay BF16, as the DeepSeek-V3
and Qwen3-FP8 checkpoints keep them.  :func:`rollout_state_dict` converts a state dict and
:func:`export_checkpoint` writes the FP8 checkpoint directory (``dcr fp8 export``): the same
code every refit's reference is built with, so a fresh engine load of an export is the
reference a receiver's bits are compared with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcr.errors import CheckpointError, ConfigError
from dcr.models.hf import CONFIG_FILE, INDEX_FILE, read_checkpoint, write_tensors
from dcr.tensors.fp8 import QUANTIZED_WEIGHT, Fp8Scheme, quantize, quantized_names

__all__ = [
    "QUANTIZED_WEIGHT",
    "export_checkpoint",
    "quantization_config",
    "quantized_names",
    "rollout_names",
    "rollout_state_dict",
    "scheme_of_config",
]


def rollout_names(
    shapes: Mapping[str, tuple[int, ...]], scheme: Fp8Scheme
) -> dict[str, tuple[str, ...]]:
    """For each canonical tensor, the rollout checkpoint tensors made from it: the weight and
    its scales for a quantized weight, the tensor itself otherwise."""
    quantized = set(quantized_names(shapes))
    return {n: (n, scheme.scale_name(n)) if n in quantized else (n,) for n in shapes}


def rollout_state_dict(
    state_dict: Mapping[str, torch.Tensor], scheme: Fp8Scheme
) -> dict[str, torch.Tensor]:
    """The FP8 rollout checkpoint of a BF16 ``state_dict``: each quantized weight followed by
    its scales, every other tensor as it is (same order)."""
    shapes = {n: tuple(t.shape) for n, t in state_dict.items()}
    quantized = set(quantized_names(shapes))
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name not in quantized:
            out[name] = t
            continue
        if t.dtype != torch.bfloat16:
            raise ConfigError(f"an FP8 export quantizes bfloat16 weights, got {t.dtype}",
                              tensor=name, check="dtype")  # fmt: skip
        q, s = quantize(t, scheme, name=name)
        out[name] = q
        out[scheme.scale_name(name)] = s
    return out


def quantization_config(scheme: Fp8Scheme) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` that makes vLLM load the export as FP8:
    its ``fp8`` method with ``weight_block_size`` for block scales, compressed-tensors'
    ``float-quantized`` format with ``channel`` weights for per-output-channel scales.
    ``dcr`` records the scheme under ``dcr_fp8`` too, so that a directory says how it was
    made."""
    dcr = {"block": scheme.block, "rule": "amax/448, clamp 448, round to nearest even"}
    if scheme.block is not None:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [scheme.block, scheme.block],
            "dcr_fp8": dcr,
        }
    weights = {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
        "dynamic": False, "group_size": None, "block_structure": None, "actorder": None,
    }  # fmt: skip
    activations = {
        "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
        "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
    }  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": "float-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "dcr_fp8": dcr,
    }


def scheme_of_config(config: Mapping[str, Any]) -> Fp8Scheme | None:
    """The scheme an FP8 export recorded in its ``config.json`` (``None``: not an export)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, Mapping) or not isinstance(qc.get("dcr_fp8"), Mapping):
        return None
    block = qc["dcr_fp8"].get("block")
    return Fp8Scheme(None if block is None else int(block))


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"no {CONFIG_FILE} in {os.fspath(directory)!r}",
                              check="missing") from exc  # fmt: skip
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}", check="config") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object", check="config")
    return config


def export_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    scheme: Fp8Scheme,
    *,
    shard_bytes: int | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Write the FP8 rollout checkpoint of the BF16 checkpoint directory ``source`` into
    ``destination`` (created; an existing checkpoint there is replaced): ``config.json`` with
    :func:`quantization_config` and the tensors of :func:`rollout_state_dict` in safetensors
    files (one, or files of at most ``shard_bytes`` with an index).  ``progress(done, total)``
    is called after each tensor.  Returns a summary: tensors quantized and kept, bytes in and
    out."""
    src, dst = Path(source), Path(destination)
    if src.resolve() == dst.resolve():
        raise ConfigError("an FP8 export must not overwrite its source checkpoint")
    config = _read_config(src)
    if config.get("quantization_config"):
        raise CheckpointError(f"{os.fspath(src)!r} is already quantized", check="config")
    tensors = read_checkpoint(src)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    quantized = set(quantized_names(shapes))
    if not quantized:
        raise CheckpointError(f"no weight of {os.fspath(src)!r} matches {QUANTIZED_WEIGHT.pattern}",
                              check="config")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for i, (name, t) in enumerate(tensors.items(), start=1):
        out.update(rollout_state_dict({name: t}, scheme))
        if progress is not None:
            progress(i, len(tensors))
    _write(dst, {**config, "quantization_config": quantization_config(scheme)}, out, shard_bytes)
    return {
        "scheme": scheme.describe(),
        "quantized": len(quantized),
        "kept": len(tensors) - len(quantized),
        "bytes_in": sum(t.numel() * t.element_size() for t in tensors.values()),
        "bytes_out": sum(t.numel() * t.element_size() for t in out.values()),
    }


def _write(
    out: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    shard_bytes: int | None,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tensors(out, tensors, shard_bytes=shard_bytes)
