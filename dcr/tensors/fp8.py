"""FP8 quantization of BF16 weights, specified to the bit (``docs/fp8.md``).

A rollout engine may serve an FP8 quantization of the trainer's BF16 checkpoint: each quantized
weight becomes ``float8_e4m3fn`` values ``q`` and ``float32`` scales ``s`` with ``w ~= q * s``,
one scale per *tile*: a ``block x block`` tile of the matrix (:class:`Fp8Scheme` with a block,
as the DeepSeek-V3 and Qwen3-FP8 checkpoints use, 128 x 128) or one output row (per-output-
channel scales, ``block=None``).  The quantizer is deterministic, so a tile whose BF16 values
did not change quantizes to the same bits again; for each tile, in ``float32``:

1. ``amax = max |w|`` over the tile (exact: every BF16 value is a ``float32``);
2. ``s = max(amax / 448, 2**-126)`` (one correctly rounded division; ``2**-126``, the smallest
   normal ``float32``, only for a tile of zeros or of values below ``448 * 2**-126``);
3. ``q = e4m3fn(clamp(w / s, -448, 448))``: a correctly rounded division, a clamp to the
   largest finite ``e4m3fn`` magnitude, then rounding to nearest, ties to even mantissa.

Every step is a correctly rounded IEEE operation, so the bits are the same on every CPU and GPU.
Weights that are not finite are refused (:class:`~dcr.errors.ConfigError`): no FP8 checkpoint
holds them.

:func:`quantize` converts a whole tensor; :func:`touched_tiles` marks the tiles a set of
changed elements falls in and :func:`requantize` converts only those, against the committed
``q`` and ``s``, giving the positions and values that changed: what an owner sends.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import ConfigError
from dcr.tensors.records import TensorSpec

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZED_WEIGHT",
    "SCALE_DTYPE",
    "SCALE_MIN",
    "Fp8Delta",
    "Fp8Scheme",
    "dequantize",
    "quantize",
    "quantized_names",
    "requantize",
    "rollout_catalog",
    "tile_amax",
    "touched_tiles",
]

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` magnitude."""
SCALE_MIN = 2.0**-126
"""The smallest scale: the smallest normal ``float32``."""


QUANTIZED_WEIGHT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
"""Checkpoint names of the weights an FP8 rollout quantizes (matrices only): the linear weights
of attention and MLP blocks, the experts' included; norms, embeddings, the LM head and MoE
routers (``mlp.gate``) stay BF16, as the DeepSeek-V3 and Qwen3-FP8 checkpoints keep them."""


def quantized_names(shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The names of ``shapes`` (checkpoint name -> shape) that an FP8 rollout quantizes, in
    order."""
    return [n for n, s in shapes.items() if len(s) == 2 and QUANTIZED_WEIGHT.search(n)]


def rollout_catalog(
    catalog: Mapping[str, TensorSpec], scheme: Fp8Scheme, quantized: Iterable[str] | None = None
) -> dict[str, TensorSpec]:
    """The catalog an FP8 rollout's receivers hold, from the canonical (BF16) ``catalog``: each
    weight of ``quantized`` (default: :func:`quantized_names` of its BF16 matrices) as its
    ``float8_e4m3fn`` values under the same name, followed by its ``float32`` scales."""
    if quantized is None:
        bf16 = {n: s.shape for n, s in catalog.items() if s.dtype == torch.bfloat16}
        quantized = quantized_names(bf16)
    chosen = set(quantized)
    out: dict[str, TensorSpec] = {}
    for name, spec in catalog.items():
        if name not in chosen:
            out[name] = spec
            continue
        out[name] = TensorSpec(name=name, shape=spec.shape, dtype=FP8_DTYPE)
        scale = scheme.scale_name(name)
        out[scale] = TensorSpec(name=scale, shape=scheme.scale_shape(spec.shape), dtype=SCALE_DTYPE)
    return out


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """Where the scales apply: ``block x block`` tiles (``block`` a positive int), or one scale
    per output row (``block=None``, per-output-channel)."""

    block: int | None = 128

    def __post_init__(self) -> None:
        if self.block is not None and (not isinstance(self.block, int) or self.block < 1):
            raise ConfigError(f"an FP8 block size must be a positive integer, got {self.block!r}")

    @property
    def kind(self) -> str:
        """``"block"`` or ``"channel"``."""
        return "channel" if self.block is None else "block"

    def tile_grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Tiles along each dimension of a matrix of ``shape``."""
        rows, cols = _matrix(shape)
        if self.block is None:
            return rows, 1
        return -(-rows // self.block), -(-cols // self.block)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape of the scale tensor of a weight of ``shape``: the tile grid."""
        return self.tile_grid(shape)

    def scale_name(self, weight: str) -> str:
        """Checkpoint name of the scales of ``weight`` (``X.weight`` -> ``X.weight_scale_inv``
        for block scales, as vLLM's ``fp8`` format names them; ``X.weight_scale`` for channel
        scales, as compressed-tensors does)."""
        return f"{weight}_scale_inv" if self.block is not None else f"{weight}_scale"

    def describe(self) -> str:
        return "per-output-channel" if self.block is None else f"{self.block}x{self.block} block"


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ConfigError(f"FP8 quantization takes a matrix, got shape {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _quantize_tiles(
    tiles: torch.Tensor, name: str | None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiles``: ``[n, r, c]`` of any float dtype whose values are ``float32``-exact (padding
    zeros allowed) -> ``q [n, r, c]`` and ``s [n]``.  ``amax`` (``float32 [n]``): each tile's
    ``max |w|`` taken over more than these values (a tile split between owners, see
    :func:`tile_amax`) instead of over them."""
    x = tiles.to(torch.float32)
    if amax is None:
        amax = x.abs().amax(dim=(1, 2)) if x.numel() else x.new_zeros(x.shape[0])
    elif tuple(amax.shape) != (x.shape[0],) or amax.dtype != torch.float32:
        raise ConfigError(f"shared amax is {amax.dtype}{list(amax.shape)}, expected float32"
                          f"[{x.shape[0]}]", tensor=name, check="fp8-amax")  # fmt: skip
    if not bool(torch.isfinite(amax).all()):
        raise ConfigError("a weight to quantize holds a value that is not finite",
                          tensor=name, check="fp8-finite")  # fmt: skip
    s = torch.clamp_min(amax / FP8_MAX, SCALE_MIN)
    x.div_(s[:, None, None]).clamp_(-FP8_MAX, FP8_MAX)
    return x.to(FP8_DTYPE), s


def _tiles_view(w: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """``w`` as ``[tile_rows, b, tile_cols, b]`` (padded with zeros to whole tiles, a copy, when
    the block does not divide its shape) or, per channel, ``[rows, 1, cols]``."""
    rows, cols = _matrix(tuple(w.shape))
    if scheme.block is None:
        return w.reshape(rows, 1, cols)
    b = scheme.block
    tr, tc = scheme.tile_grid((rows, cols))
    if rows % b or cols % b:
        padded = w.new_zeros((tr * b, tc * b))
        padded[:rows, :cols] = w
        w = padded
    return w.reshape(tr, b, tc, b)


def quantize(
    w: torch.Tensor,
    scheme: Fp8Scheme,
    *,
    name: str | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: the ``float8_e4m3fn`` values of matrix ``w`` and its ``float32`` scales of
    :meth:`Fp8Scheme.scale_shape`, by the rule in the module docstring.

    ``amax`` (``float32``, one per tile in row-major tile order): ``w`` holds part of each
    tile's values (zeros elsewhere: a piece of a weight its owners split) and ``amax`` each
    tile's ``max |w|`` over the whole tile (:func:`tile_amax` of every piece, maximised): the
    scales are the whole weight's and ``q`` its FP8 values where ``w`` holds them, bit for
    bit."""
    rows, cols = _matrix(tuple(w.shape))
    tiles = _tiles_view(w.detach(), scheme)
    if scheme.block is None:
        q, s = _quantize_tiles(tiles, name, amax)
        return q.reshape(rows, cols), s.reshape(rows, 1)
    tr, b, tc, _ = tiles.shape
    q, s = _quantize_tiles(tiles.permute(0, 2, 1, 3).reshape(tr * tc, b, b), name, amax)
    q = q.reshape(tr, tc, b, b).permute(0, 2, 1, 3).reshape(tr * b, tc * b)
    return q[:rows, :cols].contiguous(), s.reshape(tr, tc)


def tile_amax(w: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """``float32``, one per tile of :meth:`Fp8Scheme.tile_grid` in row-major order: each
    tile's ``max |w|`` over the values ``w`` holds (zeros elsewhere); the maximum over every
    owner's piece of a tile is the tile's own, exactly.  A tile holding a value that is not
    finite gives ``inf`` (never NaN, so a maximum over owners keeps it), which the quantizer
    refuses (``check="fp8-finite"``) on every owner of the tile."""
    tiles = _tiles_view(w.detach(), scheme)
    if scheme.block is not None:
        tiles = tiles.permute(0, 2, 1, 3)
    tiles = tiles.reshape(int(np.prod(scheme.tile_grid(tuple(w.shape)))), -1)
    if tiles.shape[1] == 0:
        return torch.zeros(tiles.shape[0], dtype=torch.float32)
    amax = tiles.abs().amax(dim=1).to(torch.float32)
    return torch.nan_to_num(amax, nan=math.inf)


def dequantize(q: torch.Tensor, s: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """``q * s`` in ``float32``, each value times its tile's scale (for checks, not refit)."""
    rows, cols = _matrix(tuple(q.shape))
    if scheme.block is None:
        return q.to(torch.float32) * s.reshape(rows, 1)
    b = scheme.block
    full = s.repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]
    return q.to(torch.float32) * full


def touched_tiles(
    changed: npt.NDArray[np.int64] | torch.Tensor, shape: tuple[int, ...], scheme: Fp8Scheme
) -> npt.NDArray[np.int64]:
    """Flat indices into the tile grid (:meth:`Fp8Scheme.tile_grid`, row-major) of the tiles
    that hold at least one of the ``changed`` flat element indices of a matrix of ``shape``;
    sorted, unique (one pass over the indices and a mask over the grid: no sort)."""
    _, cols = _matrix(shape)
    idx = np.asarray(changed, dtype=np.int64).reshape(-1)
    tr, tc = scheme.tile_grid(shape)
    mask = np.zeros(tr * tc, dtype=np.bool_)
    if scheme.block is None:
        mask[idx // cols] = True
    else:
        b = scheme.block
        mask[(idx // (cols * b)) * tc + (idx % cols) // b] = True
    return np.flatnonzero(mask)


@dataclass(frozen=True, slots=True)
class Fp8Delta:
    """What re-quantizing some tiles changed: flat indices into ``q`` and into ``s``, with
    their new values (``q_values`` as ``uint8`` bit patterns, ``s_values`` as ``float32``);
    ``tiles`` is how many tiles were re-quantized."""

    q_index: npt.NDArray[np.int64]
    q_values: npt.NDArray[np.uint8]
    s_index: npt.NDArray[np.int64]
    s_values: npt.NDArray[np.float32]
    tiles: int

    @property
    def empty(self) -> bool:
        return not (self.q_index.shape[0] or self.s_index.shape[0])


def requantize(
    w: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    tiles: npt.NDArray[np.int64],
    scheme: Fp8Scheme,
    *,
    name: str | None = None,
    update: bool = False,
    amax: torch.Tensor | None = None,
) -> Fp8Delta:
    """Quantize only ``tiles`` (flat tile-grid indices, e.g. from :func:`touched_tiles`) of the
    new weight ``w`` and compare them bitwise with the committed ``q`` and ``s``; the result is
    the elements of ``q`` and ``s`` whose bits changed.  ``update`` writes the new bits into
    ``q`` and ``s`` as well (the residual baseline moving to the new version).  ``amax``: the
    whole tiles' ``max |w|`` of a piece ``w`` of a weight (one per tile, see :func:`quantize`).

    A tile whose BF16 values did not change gives the same bits, so the delta is the same as
    comparing a full :func:`quantize` of ``w`` with ``(q, s)``; the cost follows the tiles.
    """
    rows, cols = _matrix(tuple(w.shape))
    if tuple(q.shape) != (rows, cols) or q.dtype != FP8_DTYPE:
        raise ConfigError(
            f"committed FP8 values are {q.dtype}{list(q.shape)}, expected {FP8_DTYPE}"
            f"{[rows, cols]}", tensor=name, check="fp8-baseline",
        )  # fmt: skip
    if tuple(s.shape) != scheme.scale_shape((rows, cols)) or s.dtype != SCALE_DTYPE:
        raise ConfigError(
            f"committed FP8 scales are {s.dtype}{list(s.shape)}, expected {SCALE_DTYPE}"
            f"{list(scheme.scale_shape((rows, cols)))}", tensor=name, check="fp8-baseline",
        )  # fmt: skip
    t = torch.as_tensor(np.asarray(tiles, dtype=np.int64))
    n = int(t.numel())
    empty_i, empty_u8 = np.empty(0, np.int64), np.empty(0, np.uint8)
    if n == 0:
        return Fp8Delta(empty_i, empty_u8, empty_i, np.empty(0, np.float32), 0)
    s_flat = s.reshape(-1)
    if amax is not None and tuple(amax.shape) != (s_flat.shape[0],):
        raise ConfigError(f"a shared amax is float32[{s_flat.shape[0]}], one per tile, got "
                          f"{list(amax.shape)}", tensor=name, check="fp8-amax")  # fmt: skip
    if n * 2 > s_flat.shape[0]:
        # Most tiles: quantizing the whole matrix costs no more, and its row-major result
        # compares in one pass, already in index order.
        return _requantize_all(w, q, s, n, scheme, name=name, update=update, amax=amax)
    if scheme.block is None:
        shared = None if amax is None else amax[t]
        new_q, new_s = _quantize_tiles(w.detach()[t].reshape(n, 1, cols), name, shared)
        new_q = new_q.reshape(n, cols)
        old_q = q[t]
        qbits, obits = new_q.view(torch.uint8), old_q.view(torch.uint8)
        diff = (qbits != obits).nonzero()
        q_index = (t[diff[:, 0]] * cols + diff[:, 1]).numpy()
        q_values = qbits[diff[:, 0], diff[:, 1]].numpy()
        if update:
            q[t] = new_q
    else:
        b = scheme.block
        _, tc = scheme.tile_grid((rows, cols))
        ti, tj = t // tc, t % tc
        grid = _tiles_view(w.detach(), scheme)
        new_q, new_s = _quantize_tiles(grid[ti, :, tj, :], name, None if amax is None else amax[t])
        qgrid = _tiles_view(q.view(torch.uint8), scheme)
        old = qgrid[ti, :, tj, :]
        qbits = new_q.view(torch.uint8)
        diff = (qbits != old).nonzero()
        r = ti[diff[:, 0]] * b + diff[:, 1]
        c = tj[diff[:, 0]] * b + diff[:, 2]
        q_index = (r * cols + c).numpy()
        q_values = qbits[diff[:, 0], diff[:, 1], diff[:, 2]].numpy()
        if update:
            qv = q.view(torch.uint8)
            qv[r, c] = qbits[diff[:, 0], diff[:, 1], diff[:, 2]]
    s_old = s_flat[t]
    s_changed = (new_s.view(torch.int32) != s_old.view(torch.int32)).nonzero().reshape(-1)
    s_index = t[s_changed].numpy()
    s_values = new_s[s_changed].numpy()
    if update:
        s_flat[t[s_changed]] = new_s[s_changed]
    order = np.argsort(q_index, kind="stable")
    return Fp8Delta(q_index[order], q_values[order], s_index, s_values, n)


def _requantize_all(
    w: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    tiles: int,
    scheme: Fp8Scheme,
    *,
    name: str | None,
    update: bool,
    amax: torch.Tensor | None,
) -> Fp8Delta:
    new_q, new_s = quantize(w, scheme, name=name, amax=amax)
    new_bits = new_q.view(torch.uint8).numpy().reshape(-1)
    q_index = np.flatnonzero(new_bits != q.view(torch.uint8).numpy().reshape(-1))
    new_scales = new_s.numpy().reshape(-1)
    s_index = np.flatnonzero(new_scales.view(np.uint32) != s.numpy().reshape(-1).view(np.uint32))
    delta = Fp8Delta(q_index, new_bits[q_index], s_index, new_scales[s_index], tiles)
    if update:
        q.copy_(new_q)
        s.copy_(new_s)
    return delta
