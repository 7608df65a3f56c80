"""Tiny Hugging Face checkpoint directories built locally, for tests that run a real serving
runtime (vLLM) on the checkpoints of :mod:`dcr.models.families`.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` -- or, sharded, files
``model-0000k-of-0000n.safetensors`` and the ``model.safetensors.index.json`` naming the file of
every tensor, as ``save_pretrained`` writes large models.  Where ``transformers`` is installed
(as in every environment with a serving runtime) ``config.json`` is written by the family's
config class, so runtimes parse it exactly as they parse a downloaded model; elsewhere it is
the config dict itself, which is all dcr reads of it.  No tokenizer is written: runtimes are
started with their tokenizer disabled.  ``safetensors`` and ``transformers`` are imported only
when a function here runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcr.errors import ConfigError
from dcr.models.families import canonical_shapes
from dcr.tensors.bits import dtype_name

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "read_checkpoint",
    "write_checkpoint",
    "write_tensors",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_INSTALL_HINT = "needs safetensors (pip install safetensors)"


def _check_state_dict(
    config: Mapping[str, Any], family: str, state_dict: Mapping[str, torch.Tensor]
) -> torch.dtype:
    """Names and shapes must be the family's checkpoint tensors; one floating dtype throughout."""
    expected = canonical_shapes(dict(config), family)
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ConfigError(
            f"state dict does not match the {family} checkpoint layout: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}",
            check="name",
        )
    dtypes = set()
    for name, shape in expected.items():
        t = state_dict[name]
        if tuple(t.shape) != shape:
            raise ConfigError(
                f"shape {tuple(t.shape)} != expected {shape}", tensor=name, check="shape"
            )
        dtypes.add(t.dtype)
    if len(dtypes) != 1:
        raise ConfigError(
            f"checkpoint mixes dtypes {sorted(dtype_name(d) for d in dtypes)}", check="dtype"
        )
    return dtypes.pop()


def write_checkpoint(
    directory: str | os.PathLike[str],
    config: Mapping[str, Any],
    family: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    shard_bytes: int | None = None,
) -> Path:
    """Write ``config`` and ``state_dict`` as a Hugging Face checkpoint directory; returns it.

    ``config`` is a dict from :func:`dcr.models.families.tiny_config` (any family field may be
    overridden); its ``model_type`` must belong to ``family``.  The state dict must hold exactly
    the family's checkpoint tensors (:func:`~dcr.models.families.canonical_shapes`), all of one
    dtype, which is recorded in the config.  ``shard_bytes`` shards the tensors, in checkpoint
    order, into files of at most that many bytes of data (a larger tensor gets a file of its
    own) with an index, as ``save_pretrained`` does.  An existing checkpoint in ``directory``
    is replaced.
    """
    if config.get("model_type") != family:
        raise ConfigError(
            f"config model_type {config.get('model_type')!r} does not match family {family!r}",
            check="family",
        )
    dtype = _check_state_dict(config, family, state_dict)

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        old.unlink(missing_ok=True)
    _write_config(out, config, family, dtype)
    write_tensors(out, state_dict, shard_bytes=shard_bytes)
    return out


def write_tensors(
    out: Path, tensors: Mapping[str, torch.Tensor], *, shard_bytes: int | None = None
) -> None:
    """Write ``tensors`` into ``out`` as ``model.safetensors``, or, with ``shard_bytes``, in
    checkpoint order into files of at most that many bytes of data (a larger tensor gets a file
    of its own) with an index, as ``save_pretrained`` does."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError(f"writing a checkpoint {_INSTALL_HINT}") from exc

    flat = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    if shard_bytes is None:
        save_file(flat, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = 0
    for name, t in flat.items():
        size = t.numel() * t.element_size()
        if shards[-1] and held + size > shard_bytes:
            shards.append({})
            held = 0
        shards[-1][name] = t
        held += size
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in flat.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(out: Path, config: Mapping[str, Any], family: str, dtype: torch.dtype) -> None:
    """``config.json``: through the family's ``transformers`` config class where it is
    installed, else the config dict with its dtype."""
    try:
        from transformers import AutoConfig
    except ImportError:
        text = json.dumps({**config, "dtype": dtype_name(dtype)}, indent=2, sort_keys=True)
        (out / CONFIG_FILE).write_text(text + "\n")
        return
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    try:
        hf_config = AutoConfig.for_model(family, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"transformers rejected the {family} config: {exc}") from exc
    hf_config.architectures = list(config.get("architectures", []))
    hf_config.dtype = dtype_name(dtype)
    hf_config.save_pretrained(out)


def read_checkpoint(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``directory`` (safetensors holds raw
    tensor bytes and a JSON header, so reading it runs no code)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ConfigError(f"read_checkpoint {_INSTALL_HINT}") from exc

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors file in {os.fspath(directory)!r}", check="checkpoint")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        for name, t in load_file(str(path)).items():
            if name in out:
                raise ConfigError(
                    f"tensor stored twice (again in {path.name})", tensor=name, check="checkpoint"
                )
            out[name] = t
    return out
