"""Tiny Hugging Face checkpoint directories built locally, for tests that run a real serving
runtime (vLLM) on the checkpoints of :mod:`dcr.testing.models`.

A checkpoint directory holds ``config.json`` (written by the family's ``transformers`` config
class, so runtimes parse it exactly as they parse a downloaded model) and ``model.safetensors``.
No tokenizer is written: runtimes are started with their tokenizer disabled.  ``transformers``
and ``safetensors`` are imported only when a function here runs (``pip install 'dcr[vllm]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcr.delta.bits import dtype_name
from dcr.errors import ConfigError
from dcr.testing.models import canonical_shapes

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "read_checkpoint", "write_checkpoint"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

_INSTALL_HINT = "needs transformers and safetensors (pip install 'dcr[vllm]')"


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
) -> Path:
    """Write ``config`` and ``state_dict`` as a Hugging Face checkpoint directory; returns it.

    ``config`` is a dict from :func:`dcr.testing.models.tiny_config` (any family field may be
    overridden); its ``model_type`` must belong to ``family``.  The state dict must hold exactly
    the family's checkpoint tensors (:func:`~dcr.testing.models.canonical_shapes`), all of one
    dtype, which is recorded in the config.  An existing checkpoint in ``directory`` is replaced.
    """
    if config.get("model_type") != family:
        raise ConfigError(
            f"config model_type {config.get('model_type')!r} does not match family {family!r}",
            check="family",
        )
    dtype = _check_state_dict(config, family, state_dict)
    try:
        from safetensors.torch import save_file
        from transformers import AutoConfig
    except ImportError as exc:
        raise ConfigError(f"write_checkpoint {_INSTALL_HINT}") from exc

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    try:
        hf_config = AutoConfig.for_model(family, **fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"transformers rejected the {family} config: {exc}") from exc
    hf_config.architectures = list(config.get("architectures", []))
    hf_config.dtype = dtype_name(dtype)

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


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
