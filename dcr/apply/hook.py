"""The dispatch hook: intercept the native loader's writes into resident storage (paper §6.1).

:class:`WriteInterceptor` is a ``TorchDispatchMode`` active while the native loader runs on one
item.  Every ATen op that writes a tensor (found from the op schema: arguments whose alias
info is a write, which covers in-place ops and ``out=`` arguments) is checked against the
*protected* storages -- every parameter and buffer of the receiver -- and against the scratch:

* a write into protected storage is recorded and **not executed**: prewarm learns the loader's
  paths without changing a resident bit, and apply checks every write of the call before any
  of them lands (deferred writes).  Only ``copy_`` and constant fills are classified; any other
  write fails at once;
* a write into scratch is recorded and executed (scratch belongs to the receiver; a loader that
  mutates it breaks the XOR path, paper App. A.2 "Loader properties");
* every other op runs unchanged.

Storages are identified by ``untyped_storage().data_ptr()``, so views, slices and tied
parameters all resolve to the storage they alias.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr.apply.geometry import ViewGeometry
from dcr.errors import DcrError

__all__ = [
    "InterceptedCopy",
    "InterceptedFill",
    "InterceptedWrite",
    "SourceKind",
    "StorageInfo",
    "WriteInterceptor",
    "storage_ptr",
]

_aten = torch.ops.aten
_COPY = _aten.copy_.default
_FILLS = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


class SourceKind(enum.Enum):
    """Where an intercepted copy reads from."""

    SCRATCH = "scratch"
    """A view of the scratch buffer: the values dcr handed to the loader."""
    OTHER = "other"
    """A tensor the loader computed (a cast, ``-exp(x)``, a contiguous copy, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageInfo:
    """One protected storage: a stable label (its first tensor's name), index and size."""

    label: str
    index: int
    nbytes: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class InterceptedCopy:
    """An ``aten.copy_`` into protected storage, recorded instead of executed.

    ``src`` is the source as the loader passed it when it is a scratch view, or a private clone
    when the loader computed it (so later loader ops cannot change the values dcr writes).
    ``src_geometry`` is the source broadcast to the destination shape, as ``copy_`` reads it.
    """

    dst: torch.Tensor
    src: torch.Tensor
    storage: StorageInfo
    dst_geometry: ViewGeometry
    src_geometry: ViewGeometry
    source: SourceKind


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class InterceptedFill:
    """A constant fill (``fill_`` / ``zero_``) into protected storage, recorded, not executed."""

    dst: torch.Tensor
    storage: StorageInfo
    dst_geometry: ViewGeometry
    value: bool | int | float


InterceptedWrite = InterceptedCopy | InterceptedFill


def storage_ptr(t: torch.Tensor) -> int | None:
    """Data pointer of the storage ``t`` aliases, or ``None`` for storage-less tensors."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


_WRITE_ARGS: dict[Any, tuple[tuple[int, str, bool], ...]] = {}


def _write_args(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """``(position, name, keyword-only)`` of the arguments ``func`` writes (cached per op)."""
    found = _WRITE_ARGS.get(func)
    if found is None:
        found = tuple(
            (i, arg.name, arg.kwarg_only)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITE_ARGS[func] = found
    return found


def _written_tensors(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i, name, kwarg_only in _write_args(func):
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _scalar(value: Any) -> bool | int | float:
    if isinstance(value, torch.Tensor):
        return value.item()  # a 0-d fill value; the mode is popped while it is read
    if isinstance(value, bool | int | float):
        return value
    raise TypeError(f"unsupported fill value {value!r}")


class WriteInterceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records (and withholds) writes into protected storage while the loader runs.

    ``fail`` builds the error for a write dcr cannot classify (``LoaderPathUnsupported`` during
    prewarm, ``LoaderConditionViolated`` during apply); it is raised inside the loader so the
    loader stops, and kept in :attr:`failure` in case the loader swallows it.
    """

    def __init__(
        self,
        protected: Mapping[int, StorageInfo],
        scratch_ptr: int,
        fail: Callable[[str, str], DcrError],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._protected = protected
        self._scratch_ptr = scratch_ptr
        self._fail = fail
        self.writes: list[InterceptedWrite] = []
        self.scratch_writes: list[str] = []
        self.failure: DcrError | None = None

    def _raise(self, message: str, check: str) -> NoReturn:
        err = self._fail(message, check)
        if self.failure is None:
            self.failure = err
        raise err

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        # The mode is popped while this runs, so the torch calls below are not intercepted.
        kwargs = kwargs or {}
        targets = _written_tensors(func, args, kwargs)
        if not targets:
            return func(*args, **kwargs)
        ptrs = [storage_ptr(t) for t in targets]
        hits = [
            (t, self._protected[p])
            for t, p in zip(targets, ptrs, strict=True)
            if p is not None and p in self._protected
        ]
        if hits:
            return self._intercept(func, args, hits)
        if self._scratch_ptr in ptrs:
            self.scratch_writes.append(str(func))
        return func(*args, **kwargs)

    def _intercept(
        self,
        func: Any,
        args: Sequence[Any],
        hits: list[tuple[torch.Tensor, StorageInfo]],
    ) -> Any:
        dst, info = hits[0]
        if len(hits) != 1 or dst is not args[0]:
            self._raise(f"{func} writes resident storage {info.label!r}", "unclassified-write")
        geometry = ViewGeometry.of(dst, info.label)
        if func is _COPY:
            src = args[1]
            if not isinstance(src, torch.Tensor):
                self._raise(f"copy_ into {info.label!r} from a non-tensor", "unclassified-write")
            ptr = storage_ptr(src)
            if ptr is not None and ptr in self._protected:
                # Deferred writes would make such a copy read stale resident bits.
                self._raise(
                    f"copy_ into {info.label!r} reads resident storage "
                    f"{self._protected[ptr].label!r}",
                    "resident-source",
                )
            kind = SourceKind.SCRATCH if ptr == self._scratch_ptr else SourceKind.OTHER
            src_geometry = ViewGeometry.of(src, kind.value).broadcast_to(geometry.shape)
            self.writes.append(
                InterceptedCopy(
                    dst=dst,
                    src=src if kind is SourceKind.SCRATCH else src.clone(),
                    storage=info,
                    dst_geometry=geometry,
                    src_geometry=src_geometry,
                    source=kind,
                )
            )
            return dst
        if func in _FILLS:
            value = 0 if func is _aten.zero_.default else _scalar(args[1])
            self.writes.append(
                InterceptedFill(dst=dst, storage=info, dst_geometry=geometry, value=value)
            )
            return dst
        self._raise(f"{func} writes resident storage {info.label!r}", "unclassified-write")
