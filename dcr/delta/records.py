"""Records in canonical coordinates: tensor specs, encodings and items.

An *item* holds one owner's entries for one canonical tensor (paper §6.1): sorted, unique flat
indices into the canonical tensor and one value per index, which is either an XOR mask of the
stored bits or the new stored bits themselves (an absolute overwrite).  Items are what the codec
packs into payloads and what receivers apply through their native loader.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.delta.bits import DTYPE_CODES, dtype_name, numpy_bits_dtype
from dcr.errors import ConfigError
from dcr.protocol.types import Mode  # one enum for the protocol core and the data plane

__all__ = ["Encoding", "Item", "Mode", "TensorSpec"]


class Encoding(enum.IntEnum):
    """How an entry's value is applied.  Values are wire codes: never renumber."""

    XOR = 0
    """``stored ^= mask``; only on bit-preserving paths with no overlapping writes."""
    OVERWRITE = 1
    """``stored = value`` (cast/transformed by the loader like a dense load would)."""
    ULP = 2
    """``stored = unordered(ordered(stored) + delta)`` modulo the word width
    (:mod:`dcr.delta.ordered`); like XOR relative to the base, only on bit-preserving paths
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
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSpec:
        return cls(name=name, shape=tuple(t.shape), dtype=t.dtype)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Item:
    """One owner's entries for one canonical tensor.

    ``indices`` are flat C-order indices into the canonical tensor, strictly increasing;
    ``values`` has the unsigned integer type of the tensor's dtype width and one entry per index.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    encoding: Encoding
    indices: npt.NDArray[np.int64]
    values: npt.NDArray[np.unsignedinteger[Any]]
    verified: bool = False
    """Set by dcr's payload decoder: ``indices`` were checked strictly increasing and inside
    the tensor, so a receiver need not scan them again."""

    @property
    def count(self) -> int:
        return int(self.indices.shape[0])

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(name=self.name, shape=self.shape, dtype=self.dtype)

    def validate(self) -> None:
        """Check the invariants an encoder relies on; raises :class:`ConfigError`."""
        n = math.prod(self.shape)
        if self.indices.dtype != np.int64 or self.indices.ndim != 1:
            raise ConfigError("indices must be a 1-D int64 array", tensor=self.name)
        if self.values.dtype != numpy_bits_dtype(self.dtype) or self.values.shape != (self.count,):
            raise ConfigError(
                f"values must be {np.dtype(numpy_bits_dtype(self.dtype)).name}[{self.count}]",
                tensor=self.name,
            )
        if self.count:
            if self.indices[0] < 0 or self.indices[-1] >= n:
                raise ConfigError("index out of range", tensor=self.name, check="bounds")
            if self.count > 1 and not bool(np.all(np.diff(self.indices) > 0)):
                raise ConfigError("indices must be strictly increasing", tensor=self.name)
