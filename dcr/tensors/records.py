"""Records in canonical coordinates: tensor specs, encodings and items.

An *item* holds one owner's entries for one canonical tensor (paper §6.1): sorted, unique flat
indices into the canonical tensor and one value per index, which is either an XOR mask of the
stored bits or the new stored bits themselves (an absolute overwrite).  Items are what the codec
packs into payloads and what receivers apply through their native loader.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import ConfigError
from dcr.protocol.types import Mode  # one enum for the protocol core and the data plane
from dcr.tensors.bits import DTYPE_CODES, dtype_name, numpy_bits_dtype

__all__ = ["Encoding", "Item", "Mode", "Span", "TensorSpec"]


class Encoding(enum.IntEnum):
    """How an entry's value is applied.  Values are wire codes: never renumber."""

    XOR = 0
    """``stored ^= mask``; only on bit-preserving paths with no overlapping writes."""
    OVERWRITE = 1
    """``stored = value`` (cast/transformed by the loader like a dense load would)."""
    ULP = 2
    """``stored = unordered(ordered(stored) + delta)`` modulo the word width
    (:mod:`dcr.tensors.ordered`); like XOR relative to the base, only on bit-preserving paths
    with no overlapping writes, and only for float dtypes."""

    @property
    def relative(self) -> bool:
        """Whether the value is relative to the stored base bits (applied at most once)."""
        return self is not Encoding.OVERWRITE


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """Name, shape and dtype of one canonical (Hugging Face checkpoint) tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ConfigError(
                f"dtype {dtype_name(self.dtype)} is not supported", tensor=self.name, check="dtype"
            )
        if any(d < 0 for d in self.shape):
            raise ConfigError(f"negative dimension in {self.shape}", tensor=self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name=name, shape=tuple(t.shape), dtype=t.dtype)


@dataclass(frozen=True, slots=True)
class Span:
    """The flat indices of an item's entries, implied rather than listed.

    Entry ``j`` lies at ``start + j + (j // period) * gap``: with ``gap == 0`` one contiguous
    run ``start, start+1, ...``; otherwise rows of ``period`` consecutive elements spread
    ``period + gap`` apart (a row-parallel shard's columns in its canonical tensor).  A dense
    refit's items are spans, so neither owners nor receivers hold an 8-byte index per element
    (:attr:`Item.span`).
    """

    start: int
    period: int = 0
    gap: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.period < 0 or self.gap < 0 or (self.gap and not self.period):
            raise ConfigError(
                f"span start {self.start}, period {self.period}, gap {self.gap} is not a span"
            )

    @property
    def is_run(self) -> bool:
        """Whether the entries are consecutive elements (whatever their count)."""
        return self.gap == 0

    def index(self, j: int) -> int:
        """Flat index of entry ``j``."""
        return self.start + j + (j // self.period) * self.gap if self.gap else self.start + j

    def locate(self, lo: int, hi: int) -> npt.NDArray[np.int64]:
        """Flat indices of entries ``lo .. hi-1`` (a new int64 array)."""
        out = np.arange(lo, hi, dtype=np.int64)
        if self.gap:
            rows = out // self.period
            rows *= self.gap
            out += rows
        out += self.start
        return out

    def follows(self, count: int, other: Span) -> bool:
        """Whether ``other`` continues this span of ``count`` entries (one span covers both)."""
        if other.period != self.period or other.gap != self.gap:
            return False
        if self.gap and count % self.period:
            return False
        return other.start == self.index(count)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, init=False)
class Item:
    """One owner's entries for one canonical tensor.

    The entries' flat C-order indices into the canonical tensor are strictly increasing; they
    are either listed (``indices``) or implied by a :class:`Span` (``span``, one run or evenly
    spaced rows, the form of dense refits).  :attr:`indices` is an int64 array either way
    (built on demand for a span: consumers that must stay small read :attr:`span` first).
    ``values`` has the unsigned integer type of the tensor's dtype width and one entry per
    index.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: Encoding
    values: npt.NDArray[np.unsignedinteger[Any]]
    span: Span | None
    """The implied indices, or ``None`` when they are listed."""
    verified: bool
    """Set by dcr's payload decoder: the indices were checked strictly increasing and inside
    the tensor, so a receiver need not scan them again."""
    listed: npt.NDArray[np.int64] | None = field(repr=False)
    """The listed indices (``None`` for a span).  The constructor takes them as ``indices``
    (or as ``listed``, which is what :func:`dataclasses.replace` passes on)."""

    def __init__(
        self,
        *,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        encoding: Encoding,
        values: npt.NDArray[np.unsignedinteger[Any]],
        indices: npt.NDArray[np.int64] | None = None,
        span: Span | None = None,
        verified: bool = False,
        listed: npt.NDArray[np.int64] | None = None,
    ) -> None:
        if indices is None:
            indices = listed
        if (indices is None) == (span is None):
            raise ConfigError("an item has either listed indices or a span", tensor=name)
        for key, value in (
            ("name", name),
            ("shape", shape),
            ("dtype", dtype),
            ("encoding", encoding),
            ("values", values),
            ("span", span),
            ("verified", verified),
            ("listed", indices),
        ):
            object.__setattr__(self, key, value)

    @property
    def indices(self) -> npt.NDArray[np.int64]:
        """Flat indices of the entries (for a span, a new array on every call)."""
        if self.listed is not None:
            return self.listed
        assert self.span is not None
        return self.span.locate(0, self.count)

    def locate(self, lo: int, hi: int) -> npt.NDArray[np.int64]:
        """Flat indices of entries ``lo .. hi-1`` (a view of listed indices, else new)."""
        if self.listed is not None:
            return self.listed[lo:hi]
        assert self.span is not None
        return self.span.locate(lo, hi)

    @property
    def count(self) -> int:
        if self.listed is not None:
            return int(self.listed.shape[0])
        return int(self.values.shape[0])

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(name=self.name, shape=self.shape, dtype=self.dtype)

    def validate(self) -> None:
        """Check the invariants an encoder relies on; raises :class:`ConfigError`."""
        n = math.prod(self.shape)
        listed = self.listed
        if listed is not None and (
            not isinstance(listed, np.ndarray) or listed.dtype != np.int64 or listed.ndim != 1
        ):
            raise ConfigError("indices must be a 1-D int64 array", tensor=self.name)
        if self.values.dtype != numpy_bits_dtype(self.dtype) or self.values.shape != (self.count,):
            raise ConfigError(
                f"values must be {np.dtype(numpy_bits_dtype(self.dtype)).name}[{self.count}]",
                tensor=self.name,
            )
        if self.count:
            first, last = self.bounds
            if first < 0 or last >= n:
                raise ConfigError("index out of range", tensor=self.name, check="bounds")
            if listed is not None and self.count > 1 and not bool(np.all(np.diff(listed) > 0)):
                raise ConfigError("indices must be strictly increasing", tensor=self.name)

    @property
    def bounds(self) -> tuple[int, int]:
        """First and last flat index of a non-empty item."""
        if self.listed is not None:
            return int(self.listed[0]), int(self.listed[-1])
        assert self.span is not None
        return self.span.start, self.span.index(self.count - 1)
