"""The FP8 rollout conversion of one owner's quantized weights (``docs/fp8.md``).

An owner that serves FP8 engines holds, for each quantized weight whose tiles it owns, the
weight's canonical BF16 values (the *mirror*) and the committed FP8 values and scales (the
*residual baseline* of paper §4.3, held by the owner of the tile).  A refit's changed BF16
elements, in canonical coordinates (what projection gives), are written into the mirror; the
tiles they touch are re-quantized (:func:`dcr.tensors.fp8.requantize`) and compared bitwise
with the baseline, and the FP8 values and scales whose bits changed become overwrite items:
construction follows the touched tiles, not the model.  A changed scale changes the FP8 bits
of unchanged weights of its tile, and those travel too (Fig. D.1).  :meth:`Fp8Rollout.commit`
moves the baseline to the candidate, :meth:`Fp8Rollout.discard` restores the mirror, and
:meth:`Fp8Rollout.dense_items` sends the committed FP8 tensors whole (a joining receiver).

An owner holds the tiles of its :class:`Fp8Region` of each weight: the rectangle of canonical
rows and columns its shards project (a tensor-parallel row or column slice, or the whole
weight), widened to tile edges (its *frame*).  A tile whose elements lie in several owners'
shards -- a row-parallel weight's rows under per-channel scales, a block tile a shard edge
cuts -- is *shared*: its scale depends on the whole tile's ``max |w|``, the maximum of its
owners' partial maxima, which the owners exchange at staging (:mod:`dcr.delta.fp8_shared`).
Each owner quantizes the values it holds with the shared scale, so no BF16 value crosses
ranks; each sends the FP8 values of its own elements, and a tile's scale is sent by the owner
of the tile's first element.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import ConfigError, LayoutError
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPE,
    Fp8Delta,
    Fp8Scheme,
    quantize,
    requantize,
    touched_tiles,
)
from dcr.tensors.records import Encoding, Item, Span, TensorSpec

__all__ = [
    "Fp8Region",
    "Fp8Rollout",
    "Fp8Stats",
    "RegionBlock",
    "overwrite_item",
    "region_values",
]


@dataclass(frozen=True, slots=True)
class RegionBlock:
    """One shard's rectangle of a quantized weight: canonical ``rows`` x ``cols``, found in
    shard ``key`` at ``offset`` with ``strides`` (elements; the shard is contiguous)."""

    key: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    offset: int
    strides: tuple[int, int]

    @classmethod
    def of(cls, key: str, canonical: torch.Tensor, shard: torch.Tensor) -> list[RegionBlock]:
        """From a ``(canonical view, shard view)`` pair of an affine mapping's blocks (views
        of meta tensors: only their geometry is read); a block of several matrices (fused
        QKV's query groups) gives one per matrix."""
        if canonical.dim() == 3 and shard.dim() == 3:
            return [
                b for i in range(canonical.shape[0]) for b in cls.of(key, canonical[i], shard[i])
            ]
        if canonical.dim() != 2 or canonical.stride(1) != 1 or shard.dim() != 2:
            raise LayoutError("a quantized weight's shard block is not a rectangle",
                              tensor=key, check="fp8-tiles")  # fmt: skip
        r0, c0 = divmod(int(canonical.storage_offset()), int(canonical.stride(0)))
        h, w = int(canonical.shape[0]), int(canonical.shape[1])
        return [cls(key, (r0, r0 + h), (c0, c0 + w), int(shard.storage_offset()),
                    (int(shard.stride(0)), int(shard.stride(1))))]  # fmt: skip

    def view(self, shard: torch.Tensor) -> torch.Tensor:
        """The rectangle's values in (contiguous) ``shard``."""
        shape = (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])
        return torch.as_strided(shard, shape, self.strides, self.offset)


@dataclass(frozen=True, slots=True)
class Fp8Region:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of canonical weight ``name`` of ``shape``:
    the tiles one owner holds."""

    name: str
    shape: tuple[int, int]
    rows: tuple[int, int]
    cols: tuple[int, int]

    @classmethod
    def whole(cls, name: str, shape: tuple[int, ...]) -> Fp8Region:
        rows, cols = int(shape[0]), int(shape[1])
        return cls(name, (rows, cols), (0, rows), (0, cols))

    @property
    def local_shape(self) -> tuple[int, int]:
        return self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]

    def frame(self, scheme: Fp8Scheme) -> tuple[tuple[int, int], tuple[int, int]]:
        """The rows and columns of the tiles this region touches: the region widened to tile
        edges (the weight's own edges at most) -- what its owner's mirror and FP8 baseline
        span.  A row is a tile of per-channel scales, so their regions are not widened."""
        b = scheme.block
        if b is None:
            return self.rows, self.cols
        rows, cols = self.shape
        (r0, r1), (c0, c1) = self.rows, self.cols
        return (r0 - r0 % b, min(rows, -(-r1 // b) * b)), (c0 - c0 % b, min(cols, -(-c1 // b) * b))

    def frame_tiles(self, scheme: Fp8Scheme) -> tuple[tuple[int, int], tuple[int, int]]:
        """The tiles of :meth:`frame`, as rows and columns of the weight's tile grid."""
        (f0, f1), (g0, g1) = self.frame(scheme)
        b = scheme.block
        if b is None:
            return (f0, f1), (0, 1)
        return (f0 // b, -(-f1 // b)), (g0 // b, -(-g1 // b))

    def sent_tiles(self, scheme: Fp8Scheme) -> tuple[tuple[int, int], tuple[int, int]]:
        """The tiles whose scales this region's owner sends: those whose first element it
        holds (a tile its owners share sends its scale once).  Possibly empty."""
        (r0, r1), (c0, c1) = self.rows, self.cols
        b = scheme.block
        if b is None:
            return (r0, r1), (0, 1 if c0 == 0 else 0)
        return (-(-r0 // b), -(-r1 // b)), (-(-c0 // b), -(-c1 // b))

    def shares_tiles(self, scheme: Fp8Scheme) -> bool:
        """Whether other owners hold part of this region's tiles: a column slice's rows under
        per-channel scales, or a region whose edges cut block tiles.  Their scales depend on
        every owner's values (:mod:`dcr.delta.fp8_shared`)."""
        if scheme.block is None:
            return self.cols != (0, self.shape[1])
        return self.frame(scheme) != (self.rows, self.cols)

    def check(self, scheme: Fp8Scheme) -> None:
        """Refuse a region outside the weight."""
        rows, cols = self.shape
        (r0, r1), (c0, c1) = self.rows, self.cols
        if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols):
            raise LayoutError(
                f"region rows {self.rows} x cols {self.cols} outside {list(self.shape)}",
                tensor=self.name, check="fp8-tiles",
            )  # fmt: skip


@dataclass(slots=True)
class Fp8Stats:
    """What one build re-quantized and changed."""

    tiles: int = 0
    tiles_touched: int = 0
    fp8_changed: int = 0
    scales_changed: int = 0
    dense: int = 0
    """Regions sent whole (``dense_above``)."""

    def as_dict(self) -> dict[str, int]:
        return {"tiles": self.tiles, "tiles_touched": self.tiles_touched,
                "fp8_changed": self.fp8_changed, "scales_changed": self.scales_changed,
                "dense": self.dense}  # fmt: skip


def _changed_tiles(
    new: npt.NDArray[np.uint16], old: npt.NDArray[np.uint16], shape: tuple[int, int],
    scheme: Fp8Scheme,
) -> npt.NDArray[np.int64]:  # fmt: skip
    """The tiles of a matrix of ``shape`` where the words ``new`` and ``old`` differ."""
    rows, cols = shape
    diff = (new != old).reshape(rows, cols)
    if scheme.block is None:
        return np.flatnonzero(diff.any(axis=1))
    b = scheme.block
    tr, tc = scheme.tile_grid(shape)
    if rows % b or cols % b:
        padded = np.zeros((tr * b, tc * b), dtype=np.bool_)
        padded[:rows, :cols] = diff
        diff = padded
    return np.flatnonzero(diff.reshape(tr, b, tc, b).any(axis=(1, 3)))


_NO_DELTA = Fp8Delta(np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.int64),
                     np.empty(0, np.float32), 0)  # fmt: skip


@dataclass(slots=True)
class _Staged:
    index: npt.NDArray[np.int64] | None
    """The mirror elements the candidate wrote (``None``: all of them, ``old`` is a copy)."""
    old: npt.NDArray[np.uint16]
    delta: Fp8Delta


class Fp8Rollout:
    """The mirror and FP8 baseline of quantized weights: ``base`` maps each canonical name to
    the committed BF16 values of its region (``regions``; by default the whole weight, and
    ``base`` the whole matrix).  The scheme's scales are named by :meth:`Fp8Scheme.scale_name`;
    indices in and out are canonical.

    Each weight's mirror, FP8 values and scales span its region's :meth:`Fp8Region.frame`
    (the region widened to tile edges, zeros where other owners hold the values: a zero
    quantizes to zero under any scale, so those never change).  A region whose tiles other
    owners share (:meth:`Fp8Region.shares_tiles`) needs its tiles' ``max |w|`` over every
    owner: ``amax`` at the committed version, and :meth:`share` of the candidate's before it
    is staged."""

    def __init__(
        self,
        scheme: Fp8Scheme,
        base: Mapping[str, torch.Tensor],
        regions: Mapping[str, Fp8Region] | None = None,
        amax: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.scheme = scheme
        self.mirror: dict[str, torch.Tensor] = {}
        self.regions: dict[str, Fp8Region] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        self.amax: dict[str, torch.Tensor] = {}
        """The committed tile maxima of the shared regions (one per :meth:`Fp8Region.frame`
        tile, row-major)."""
        self._next: dict[str, torch.Tensor] | None = None
        self._own: dict[str, tuple[slice, slice]] = {}
        """Where each region's own values lie in its frame."""
        for name, t in base.items():
            if t.dtype != torch.bfloat16 or t.dim() != 2:
                raise LayoutError(f"an FP8 rollout quantizes bfloat16 matrices, got {t.dtype}"
                                  f"{list(t.shape)}", tensor=name, check="fp8")  # fmt: skip
            region = (regions or {}).get(name) or Fp8Region.whole(name, tuple(t.shape))
            region.check(scheme)
            if tuple(t.shape) != region.local_shape:
                raise LayoutError(
                    f"region values are {list(t.shape)}, the region is "
                    f"{list(region.local_shape)}", tensor=name, check="fp8",
                )  # fmt: skip
            self.regions[name] = region
            (f0, f1), (g0, g1) = region.frame(scheme)
            (r0, r1), (c0, c1) = region.rows, region.cols
            self._own[name] = (slice(r0 - f0, r1 - f0), slice(c0 - g0, c1 - g0))
            if (f0, f1, g0, g1) == (r0, r1, c0, c1):
                self.mirror[name] = t.detach().to("cpu", copy=True).contiguous()
            else:
                self.mirror[name] = torch.zeros((f1 - f0, g1 - g0), dtype=torch.bfloat16)
                self.mirror[name][self._own[name]] = t.detach()
            shared = None
            if region.shares_tiles(scheme):
                shared = self._checked_amax(name, (amax or {}).get(name))
                self.amax[name] = shared
            self.q[name], self.s[name] = quantize(self.mirror[name], scheme, name=name,
                                                  amax=shared)  # fmt: skip
        self._staged: dict[str, _Staged] = {}
        self._specs: dict[str, TensorSpec] = {}
        for name, region in self.regions.items():
            self._specs[name] = TensorSpec(name=name, shape=region.shape, dtype=FP8_DTYPE)
            scale = scheme.scale_name(name)
            self._specs[scale] = TensorSpec(name=scale, shape=scheme.scale_shape(region.shape),
                                            dtype=SCALE_DTYPE)  # fmt: skip

    @classmethod
    def of_shards(
        cls,
        scheme: Fp8Scheme,
        regions: Mapping[str, tuple[Fp8Region, Sequence[RegionBlock]]],
        shards: Mapping[str, torch.Tensor],
        amax: Mapping[str, torch.Tensor] | None = None,
    ) -> Fp8Rollout:
        """The rollout of an owner's ``regions`` (:meth:`TrainingPlan.fp8_regions`), its
        mirror filled from the owner's committed ``shards``."""
        return cls(scheme, {n: region_values(r, b, shards) for n, (r, b) in regions.items()},
                   {n: r for n, (r, _) in regions.items()}, amax)  # fmt: skip

    def _checked_amax(self, name: str, amax: torch.Tensor | None) -> torch.Tensor:
        tiles = int(np.prod(self.scheme.tile_grid(tuple(self.mirror[name].shape))))
        if amax is None:
            raise LayoutError(
                "other owners hold part of this owner's tiles (its shards cut them, or split "
                "rows with per-channel scales): their scales need the tiles' max |w| over "
                "every owner (the training group's exchange, SharedTiles)",
                tensor=name, check="fp8-amax",
            )  # fmt: skip
        if tuple(amax.shape) != (tiles,) or amax.dtype != torch.float32:
            raise LayoutError(f"tile maxima are {amax.dtype}{list(amax.shape)}, expected "
                              f"float32[{tiles}]", tensor=name, check="fp8-amax")  # fmt: skip
        return amax.detach().to("cpu", copy=True).contiguous()

    @property
    def shared(self) -> list[str]:
        """The regions whose tiles' scales are shared with other owners."""
        return list(self.amax)

    def share(self, amax: Mapping[str, torch.Tensor]) -> None:
        """The candidate's tile maxima of every shared region, over every owner (from the
        training group's exchange at staging); needed before a shared region is staged."""
        self._next = {name: self._checked_amax(name, amax.get(name)) for name in self.amax}

    def unshare(self) -> None:
        """Forget the candidate's tile maxima (a new candidate, or none)."""
        self._next = None

    def moved(self) -> list[str]:
        """The shared regions whose tile maxima the candidate changes: their scales move,
        so they are re-quantized even where this owner's values did not change."""
        if self._next is None:
            return []
        return [n for n, a in self.amax.items() if not np.array_equal(bits(a), bits(self._next[n]))]

    def owned(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[slice, slice]]:
        """The committed FP8 values this owner holds (its region of ``q``), and the scales it
        sends with their tiles' rows and columns of the weight's tile grid (those whose first
        element it holds: possibly none)."""
        region = self.regions[name]
        (t0, t1), (u0, u1) = region.sent_tiles(self.scheme)
        (f0, _), (g0, _) = region.frame_tiles(self.scheme)
        s = self.s[name][t0 - f0 : t1 - f0, u0 - g0 : u1 - g0]
        return self.q[name][self._own[name]], s, (slice(t0, t1), slice(u0, u1))

    def _staged_amax(self, name: str) -> tuple[torch.Tensor | None, npt.NDArray[np.int64]]:
        """A shared region's candidate tile maxima and the tiles whose maximum moved (none
        for a region that shares nothing)."""
        if name not in self.amax:
            return None, np.empty(0, np.int64)
        if self._next is None:
            raise LayoutError("the candidate's shared tile maxima were not given (share())",
                              tensor=name, check="fp8-amax")  # fmt: skip
        new = self._next[name]
        return new, np.flatnonzero(bits(new) != bits(self.amax[name])).astype(np.int64)

    def stage_shards(
        self,
        shards: Mapping[str, torch.Tensor],
        regions: Mapping[str, tuple[Fp8Region, Sequence[RegionBlock]]],
        stats: Fp8Stats | None = None,
    ) -> list[Item]:
        """Stage the candidate from its ``shards`` directly (every region compared with the
        mirror): for a commit that no build reached."""
        self.discard()
        items = []
        for name, (region, blocks) in regions.items():
            items += self.stage_region(name, region_values(region, blocks, shards), stats)
        return items

    def specs(self) -> dict[str, TensorSpec]:
        """The rollout catalog entries of these weights: FP8 values and scales, canonical
        shapes."""
        return dict(self._specs)

    def _local(self, name: str, index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Canonical flat indices of ``name`` -> flat indices of its frame (refused outside
        its region)."""
        region = self.regions[name]
        (r0, r1), (c0, c1) = region.rows, region.cols
        if region.local_shape == region.shape:
            return index
        (f0, _), (g0, g1) = region.frame(self.scheme)
        cols = region.shape[1]
        r, c = np.divmod(index, cols)
        if index.shape[0] and bool(((r < r0) | (r >= r1) | (c < c0) | (c >= c1)).any()):
            raise LayoutError("a changed element outside this owner's tiles", tensor=name,
                              check="fp8-tiles")  # fmt: skip
        local: npt.NDArray[np.int64] = (r - f0) * (g1 - g0) + (c - g0)
        return local

    def _canonical(self, name: str, delta: Fp8Delta) -> Fp8Delta:
        """``delta`` of a frame with canonical indices; of the scales only those this owner
        sends (:meth:`Fp8Region.sent_tiles`)."""
        region = self.regions[name]
        if region.local_shape == region.shape:
            return delta
        (f0, _), (g0, g1) = region.frame(self.scheme)
        cols = region.shape[1]
        lr, lc = np.divmod(delta.q_index, g1 - g0)
        q_index = (lr + f0) * cols + lc + g0
        (t0, _), (u0, u1) = region.frame_tiles(self.scheme)
        _, tc = self.scheme.tile_grid(region.shape)
        ti, tj = np.divmod(delta.s_index, u1 - u0)
        ti, tj = ti + t0, tj + u0
        (a0, a1), (b0, b1) = region.sent_tiles(self.scheme)
        sent = (ti >= a0) & (ti < a1) & (tj >= b0) & (tj < b1)
        return Fp8Delta(q_index, delta.q_values, (ti * tc + tj)[sent], delta.s_values[sent],
                        delta.tiles)  # fmt: skip

    def stage(
        self,
        name: str,
        index: npt.NDArray[np.int64],
        values: npt.NDArray[np.uint16],
        stats: Fp8Stats | None = None,
        *,
        dense_above: float | None = None,
    ) -> list[Item]:
        """Write the changed BF16 elements ``index`` (canonical flat indices, increasing) and
        their new bits ``values`` into the mirror of ``name``; re-quantize the tiles they touch
        and return the overwrite items of the FP8 values and scales that changed (none when
        nothing did).  With ``dense_above``, a region whose FP8 values changed at least that
        much (as a fraction of its elements) sends them whole instead: one span item, no index
        per entry (the owners' choice between sparse and dense, ``BuildConfig.dense_above``).
        Staging a name again before commit or discard is refused."""
        mirror = self.mirror.get(name)
        if mirror is None:
            raise LayoutError("not a quantized weight of this rollout", tensor=name, check="fp8")
        if name in self._staged:
            raise LayoutError("staged twice in one refit", tensor=name, check="fp8")
        index = np.asarray(index, dtype=np.int64)
        numel = self.regions[name].shape[0] * self.regions[name].shape[1]
        if index.shape[0] and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ConfigError("changed index outside the weight", tensor=name, check="bounds")
        index = self._local(name, index)
        amax, moved = self._staged_amax(name)
        flat = bits(mirror).reshape(-1)
        old = flat[index].copy()
        flat[index] = values
        tiles = touched_tiles(index, tuple(mirror.shape), self.scheme)
        if moved.shape[0]:
            tiles = np.union1d(tiles, moved)
        staged = _Staged(index, old, _NO_DELTA)
        return self._requantize(name, tiles, staged, stats, dense_above, amax)

    def stage_region(
        self,
        name: str,
        values: torch.Tensor,
        stats: Fp8Stats | None = None,
        *,
        dense_above: float | None = None,
    ) -> list[Item]:
        """:meth:`stage` from the candidate's BF16 values of the whole region (its shape):
        compared with the mirror in one pass, no index per changed element -- for a weight
        whose elements mostly changed."""
        mirror = self.mirror.get(name)
        if mirror is None:
            raise LayoutError("not a quantized weight of this rollout", tensor=name, check="fp8")
        if name in self._staged:
            raise LayoutError("staged twice in one refit", tensor=name, check="fp8")
        own = self.regions[name].local_shape
        if tuple(values.shape) != own or values.dtype != mirror.dtype:
            raise LayoutError(
                f"region values are {values.dtype}{list(values.shape)}, expected "
                f"{mirror.dtype}{list(own)}", tensor=name, check="fp8",
            )  # fmt: skip
        amax, moved = self._staged_amax(name)
        flat = bits(mirror).reshape(-1)
        old = flat.copy()
        if own == tuple(mirror.shape):
            np.copyto(flat, bits(values).reshape(-1))
        else:
            mirror[self._own[name]] = values  # a copy of the bits; the rest of the frame stays 0
        tiles = _changed_tiles(flat, old, (mirror.shape[0], mirror.shape[1]), self.scheme)
        if moved.shape[0]:
            tiles = np.union1d(tiles, moved)
        staged = _Staged(None, old, _NO_DELTA)
        return self._requantize(name, tiles, staged, stats, dense_above, amax)

    def _requantize(
        self,
        name: str,
        tiles: npt.NDArray[np.int64],
        staged: _Staged,
        stats: Fp8Stats | None,
        dense_above: float | None,
        amax: torch.Tensor | None = None,
    ) -> list[Item]:
        """Re-quantize ``tiles`` of the mirror (which holds the candidate) and stage it."""
        mirror = self.mirror[name]
        try:
            delta = requantize(mirror, self.q[name], self.s[name], tiles, self.scheme, name=name,
                               amax=amax)  # fmt: skip
        except ConfigError:
            flat = bits(mirror).reshape(-1)
            if staged.index is None:
                flat[:] = staged.old
            else:
                flat[staged.index] = staged.old
            raise
        staged.delta = delta
        self._staged[name] = staged
        out = self._canonical(name, delta)
        if stats is not None:
            stats.tiles += int(np.prod(self.scheme.tile_grid(tuple(mirror.shape))))
            stats.tiles_touched += delta.tiles
            stats.fp8_changed += int(delta.q_index.shape[0])
            stats.scales_changed += int(out.s_index.shape[0])  # those this owner sends
        if dense_above is not None and delta.q_index.shape[0] >= dense_above * mirror.numel():
            if stats is not None:
                stats.dense += 1
            return self._dense_staged(name, delta, out)
        return self._items(name, out)

    def _dense_staged(self, name: str, local: Fp8Delta, out: Fp8Delta) -> list[Item]:
        """The staged FP8 values of ``name``'s region whole (a span item), with its changed
        scales listed."""
        region = self.regions[name]
        candidate = bits(self.q[name]).copy()
        candidate.reshape(-1)[local.q_index] = local.q_values
        (r0, _), (c0, _) = region.rows, region.cols
        span = _rect_span(region.shape[1], r0, c0, region.local_shape[1])
        own = candidate[self._own[name]].reshape(-1).copy()
        items = [_item(self._specs[name], span, own)]
        empty = Fp8Delta(np.empty(0, np.int64), np.empty(0, np.uint8), out.s_index,
                         out.s_values, out.tiles)  # fmt: skip
        return items + self._items(name, empty)

    def _items(self, name: str, delta: Fp8Delta) -> list[Item]:
        specs = self._specs
        scale = self.scheme.scale_name(name)
        items = []
        if delta.q_index.shape[0]:
            items.append(_item(specs[name], delta.q_index, delta.q_values))
        if delta.s_index.shape[0]:
            items.append(_item(specs[scale], delta.s_index, delta.s_values.view(np.uint32)))
        return items

    def commit(self) -> None:
        """The staged candidate becomes the baseline: FP8 values and scales take the changed
        bits; the mirror already holds the candidate."""
        for name, st in self._staged.items():
            d = st.delta
            bits(self.q[name]).reshape(-1)[d.q_index] = d.q_values
            bits(self.s[name]).reshape(-1)[d.s_index] = d.s_values.view(np.uint32)
            if name in self.amax:
                assert self._next is not None  # staging a shared region needs it
                self.amax[name] = self._next[name]
        self._staged = {}

    def discard(self) -> None:
        """Drop the staged candidate: the mirror gets its committed bits back."""
        for name, st in self._staged.items():
            flat = bits(self.mirror[name]).reshape(-1)
            if st.index is None:
                flat[:] = st.old
            else:
                flat[st.index] = st.old
        self._staged = {}

    def dense_items(self, names: Iterable[str] | None = None) -> list[Item]:
        """The committed FP8 values and scales of the regions of ``names`` (default: all),
        whole: one span item each (rows of the region's width, where it is a column slice)."""
        out = []
        for name in self.mirror if names is None else names:
            region = self.regions[name]
            specs = self._specs
            scale = self.scheme.scale_name(name)
            (r0, _), (c0, _) = region.rows, region.cols
            q, s, (ti, tj) = self.owned(name)
            q_span = _rect_span(region.shape[1], r0, c0, region.local_shape[1])
            out.append(_item(specs[name], q_span, bits(q.contiguous()).reshape(-1).copy()))
            if not s.numel():
                continue  # other owners hold the first elements of these tiles: they send
            _, tc = self.scheme.tile_grid(region.shape)
            s_span = _rect_span(tc, ti.start, tj.start, tj.stop - tj.start)
            out.append(_item(specs[scale], s_span, bits(s.contiguous()).reshape(-1).copy()))
        return out


def region_values(
    region: Fp8Region,
    blocks: Sequence[RegionBlock],
    shards: Mapping[str, torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A region's BF16 values, copied from the shard blocks (of ``shards``) that fill it (into
    ``out``, of the region's shape, when given)."""
    if out is None:
        out = torch.empty(region.local_shape, dtype=torch.bfloat16)
    (r0, _), (c0, _) = region.rows, region.cols
    for b in blocks:
        dst = out[b.rows[0] - r0 : b.rows[1] - r0, b.cols[0] - c0 : b.cols[1] - c0]
        dst.copy_(b.view(shards[b.key]))
    return out


def _rect_span(cols: int, r0: int, c0: int, w: int) -> Span:
    """The flat indices of a rectangle of width ``w`` from ``(r0, c0)`` in rows of ``cols``."""
    if w == cols:
        return Span(r0 * cols)
    return Span(r0 * cols + c0, period=w, gap=cols - w)


def _item(spec: TensorSpec, where: npt.NDArray[np.int64] | Span, values: Any) -> Item:
    return Item(
        name=spec.name, shape=spec.shape, dtype=spec.dtype, encoding=Encoding.OVERWRITE,
        values=values, indices=None if isinstance(where, Span) else where,
        span=where if isinstance(where, Span) else None,
    )  # fmt: skip


def overwrite_item(
    name: str, t: torch.Tensor, index: npt.NDArray[np.int64] | None, values: Any
) -> Item:
    return Item(
        name=name, shape=tuple(t.shape), dtype=t.dtype, encoding=Encoding.OVERWRITE,
        values=values, indices=index, span=Span(0) if index is None else None,
    )  # fmt: skip
