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

from dcr.delta.bits import bits


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
