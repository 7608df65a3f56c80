"""What every affine index mapping shares (paper §4.2, App. A.1): the mapping interface
(:class:`AffineMapping`), its results (:class:`Destination`, :class:`Segment`) and the index
arithmetic helpers the mapping classes use."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.errors import LayoutError

Index = npt.NDArray[np.int64]
Canonical = Mapping[str, torch.Tensor]
Blocks = list[tuple[str, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Destination:
    """Where a subset of projected source elements lands.

    ``select`` picks positions of the input index array (``None``: all of them, in order);
    ``indices`` are the canonical flat indices of the selected elements, in the same order.
    """

    name: str
    indices: Index
    select: Index | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A range of local flat indices that maps to canonical coordinates by one affine formula.

    Local ``j`` in ``[start, stop)`` lands at canonical ``j + offset`` when ``period`` is 0,
    else at ``j + (j // period) * gap + offset`` (row-parallel splits: rows of ``period``
    local elements spread ``period + gap`` apart); the same index lands in every tensor of
    ``names``.  Both formulas are strictly increasing in ``j``, so sorted local indices give
    sorted canonical ones.  :meth:`AffineMapping.segments` covers every projected element
    once and nothing else; construction scans segments block by block instead of projecting
    index arrays through :meth:`AffineMapping.project`.
    """

    start: int
    stop: int
    names: tuple[str, ...]
    offset: int
    period: int = 0
    gap: int = 0

    def canonical(self, local: Index) -> Index:
        """Canonical flat indices of local flat indices in this segment (a new array; one
        pass in C when :mod:`dcr.native` has its kernels)."""
        if not self.period:
            return local + self.offset
        k = native.kernels
        if k is not None and local.dtype == np.int64 and local.flags.c_contiguous:
            spread = np.empty(local.shape[0], dtype=np.int64)
            k.spread_rows(local, self.period, self.gap, self.offset, spread)
            return spread
        out = local // self.period
        out *= self.gap
        out += local
        out += self.offset
        return out

    def renamed(self, names: tuple[str, ...]) -> Segment:
        return Segment(self.start, self.stop, names, self.offset, self.period, self.gap)


def _divide(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise LayoutError(f"{what}: {a} is not divisible by {b}", check="divisibility")
    return a // b


def _cols(shape: tuple[int, ...]) -> int:
    """Elements per row (1 for 1-D tensors)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


class AffineMapping(ABC):
    """A fixed map from one source shard's local flat indices to canonical coordinates."""

    @property
    @abstractmethod
    def source_shape(self) -> tuple[int, ...]:
        """Shape of the local source shard."""

    @property
    @abstractmethod
    def names(self) -> tuple[str, ...]:
        """Canonical tensors this mapping writes."""

    @abstractmethod
    def project(self, local: Index) -> list[Destination]:
        """Canonical destinations of the local flat indices ``local`` (int64, any order).

        Elements with no destination (vocabulary padding, replicated copies another rank
        projects) are dropped.
        """

    @abstractmethod
    def segments(self) -> list[Segment]:
        """The projected local elements as affine segments, in increasing local order.

        Equivalent to :meth:`project` (tests check one against the other); elements that
        :meth:`project` drops lie in no segment.
        """

    @abstractmethod
    def blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        """Triples ``(name, canonical view, shard view)`` covering exactly the projected elements.

        This is the dense counterpart of :meth:`project` (strided views instead of index
        arithmetic): full conversion copies shard views into canonical views with it, and
        tests check :meth:`project` against it.
        """

    def source_blocks(self, canonical: Canonical, shard: torch.Tensor) -> Blocks:
        """Triples covering every shard element that has a canonical source.

        Differs from :meth:`blocks` where a shard holds copies that another rank projects
        (key/value rows replicated across tensor-parallel ranks) or one element has several
        destinations (tied weights, where only the first is the source).
        """
        return self.blocks(canonical, shard)

    @property
    def numel(self) -> int:
        return math.prod(self.source_shape)
