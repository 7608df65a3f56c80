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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.errors import ConfigError, LayoutError
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import Fp8Delta, Fp8Scheme, quantize, requantize, touched_tiles
from dcr.tensors.records import Encoding, Item, Span, TensorSpec

__all__ = ["Fp8Rollout", "Fp8Stats", "overwrite_item"]


@dataclass(slots=True)
class Fp8Stats:
    """What one build re-quantized and changed."""

    tiles: int = 0
    tiles_touched: int = 0
    fp8_changed: int = 0
    scales_changed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"tiles": self.tiles, "tiles_touched": self.tiles_touched,
                "fp8_changed": self.fp8_changed, "scales_changed": self.scales_changed}  # fmt: skip


@dataclass(slots=True)
class _Staged:
    index: npt.NDArray[np.int64]
    old: npt.NDArray[np.uint16]
    delta: Fp8Delta


class Fp8Rollout:
    """The mirror and FP8 baseline of the quantized weights ``base`` (canonical name ->
    committed BF16 matrix); the scheme's scales are named by :meth:`Fp8Scheme.scale_name`."""

    def __init__(self, scheme: Fp8Scheme, base: Mapping[str, torch.Tensor]) -> None:
        self.scheme = scheme
        self.mirror: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.s: dict[str, torch.Tensor] = {}
        for name, t in base.items():
            if t.dtype != torch.bfloat16 or t.dim() != 2:
                raise LayoutError(f"an FP8 rollout quantizes bfloat16 matrices, got {t.dtype}"
                                  f"{list(t.shape)}", tensor=name, check="fp8")  # fmt: skip
            self.mirror[name] = t.detach().to("cpu", copy=True).contiguous()
            self.q[name], self.s[name] = quantize(self.mirror[name], scheme, name=name)
        self._staged: dict[str, _Staged] = {}

    def specs(self) -> dict[str, TensorSpec]:
        """The rollout catalog entries of these weights: FP8 values and scales."""
        out = {}
        for name in self.mirror:
            out[name] = TensorSpec.of(name, self.q[name])
            scale = self.scheme.scale_name(name)
            out[scale] = TensorSpec.of(scale, self.s[name])
        return out

    def stage(
        self,
        name: str,
        index: npt.NDArray[np.int64],
        values: npt.NDArray[np.uint16],
        stats: Fp8Stats | None = None,
    ) -> list[Item]:
        """Write the changed BF16 elements ``index`` (canonical flat indices, increasing) and
        their new bits ``values`` into the mirror of ``name``; re-quantize the tiles they touch
        and return the overwrite items of the FP8 values and scales that changed (none when
        nothing did).  Staging a name again before commit or discard is refused."""
        mirror = self.mirror.get(name)
        if mirror is None:
            raise LayoutError("not a quantized weight of this rollout", tensor=name, check="fp8")
        if name in self._staged:
            raise LayoutError("staged twice in one refit", tensor=name, check="fp8")
        index = np.asarray(index, dtype=np.int64)
        flat = bits(mirror).reshape(-1)
        if index.shape[0] and (int(index[0]) < 0 or int(index[-1]) >= flat.shape[0]):
            raise ConfigError("changed index outside the weight", tensor=name, check="bounds")
        old = flat[index].copy()
        flat[index] = values
        tiles = touched_tiles(index, tuple(mirror.shape), self.scheme)
        try:
            delta = requantize(mirror, self.q[name], self.s[name], tiles, self.scheme, name=name)
        except ConfigError:
            flat[index] = old
            raise
        self._staged[name] = _Staged(index, old, delta)
        if stats is not None:
            stats.tiles += int(np.prod(self.scheme.tile_grid(tuple(mirror.shape))))
            stats.tiles_touched += delta.tiles
            stats.fp8_changed += int(delta.q_index.shape[0])
            stats.scales_changed += int(delta.s_index.shape[0])
        return self._items(name, delta)

    def _items(self, name: str, delta: Fp8Delta) -> list[Item]:
        q, s = self.q[name], self.s[name]
        items = []
        if delta.q_index.shape[0]:
            items.append(overwrite_item(name, q, delta.q_index, delta.q_values))
        if delta.s_index.shape[0]:
            items.append(overwrite_item(self.scheme.scale_name(name), s, delta.s_index,
                                    delta.s_values.view(np.uint32)))  # fmt: skip
        return items

    def commit(self) -> None:
        """The staged candidate becomes the baseline: FP8 values and scales take the changed
        bits; the mirror already holds the candidate."""
        for name, st in self._staged.items():
            d = st.delta
            bits(self.q[name]).reshape(-1)[d.q_index] = d.q_values
            bits(self.s[name]).reshape(-1)[d.s_index] = d.s_values.view(np.uint32)
        self._staged = {}

    def discard(self) -> None:
        """Drop the staged candidate: the mirror gets its committed bits back."""
        for name, st in self._staged.items():
            bits(self.mirror[name]).reshape(-1)[st.index] = st.old
        self._staged = {}

    def dense_items(self, names: Iterable[str] | None = None) -> list[Item]:
        """The committed FP8 values and scales of ``names`` (default: all), whole."""
        out = []
        for name in self.mirror if names is None else names:
            q, s = self.q[name], self.s[name]
            out.append(overwrite_item(name, q, None, bits(q).reshape(-1).copy()))
            out.append(overwrite_item(self.scheme.scale_name(name), s, None,
                                  bits(s).reshape(-1).copy()))  # fmt: skip
        return out


def overwrite_item(
    name: str, t: torch.Tensor, index: npt.NDArray[np.int64] | None, values: Any
) -> Item:
    return Item(
        name=name, shape=tuple(t.shape), dtype=t.dtype, encoding=Encoding.OVERWRITE,
        values=values, indices=index, span=Span(0) if index is None else None,
    )  # fmt: skip
