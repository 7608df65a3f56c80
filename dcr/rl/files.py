"""Atomic files and safetensors I/O for the RL trainer's checkpoints and saved state.

Every file is written to a temporary name in its destination directory, flushed and fsynced,
renamed over the destination and the directory fsynced: a crash leaves the old file or the
new one, never a torn one.  Tensors go through the ``safetensors`` format (raw bytes behind a
JSON header, so reading runs no code), never through pickle; ``safetensors`` is imported only
when a function here runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from dcr.errors import CheckpointError, ConfigError
from dcr.files import atomic_write, fsync_dir

__all__ = ["atomic_write", "fsync_dir", "read_safetensors", "write_safetensors"]


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """``tensors`` (CPU, made contiguous) and string ``metadata`` as one safetensors file,
    written atomically."""
    try:
        from safetensors.torch import save
    except ImportError as exc:
        raise ConfigError(
            "writing safetensors needs safetensors (pip install safetensors)"
        ) from exc
    plain = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    return atomic_write(path, save(plain, metadata=dict(metadata or {})))


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file and its string metadata; a missing or malformed
    file raises :class:`~dcr.errors.CheckpointError`."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ConfigError(
            "reading safetensors needs safetensors (pip install safetensors)"
        ) from exc
    if not Path(path).is_file():
        raise CheckpointError(f"no file {os.fspath(path)!r}", check="missing")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except OSError:
        raise
    except Exception as exc:  # safetensors' own error type for a malformed file
        raise CheckpointError(
            f"unreadable safetensors file {os.fspath(path)!r}: {exc}", check="header"
        ) from exc
    return tensors, metadata
