"""A synthetic training run whose every version can be computed anywhere, element by element.

The fleet demo and the fleet tests need each process to hold *its own part* of a version:
a trainer rank its shards, a checker the canonical tensors.  :class:`SyntheticRun` defines
version ``v`` of every canonical element by a counter-based random function of (seed, tensor
name, element index, step), so any subset of elements of any version is computed without the
rest of the model and without replaying other processes' random draws:

* version 0: ``N(0, std)`` (``1 + N(0, std)`` for norm weights), rounded to the tensor's dtype;
* step ``k`` chooses each element with probability ``rate`` (or the ``k``-th of ``rates``,
  cycling) and sets it to ``round(w * (1 + relative * eps))`` computed in float32 -- the
  update :func:`perturb` makes.

Shards of a training plan are filled through the plan's own affine mappings, so a rank's
shards equal the plan's slicing of the canonical version bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.delta.layout import ShardSpec, TrainingPlan
from dcr.models.families import canonical_shapes
from dcr.tensors.bits import bits

__all__ = ["SyntheticRun"]

_BLOCK = 1 << 22
"""Elements computed at a time (bounds temporaries to some tens of MB)."""
_HASH_BLOCK = 1 << 18
"""Elements hashed at a time when choosing a step's elements (1 MiB of hash state)."""
_U32 = np.uint32


def _hash(key: np.uint32, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
    """A well-mixed 32-bit hash of ``(key, index)`` (the lowbias32 mixer, keyed)."""
    x = idx.astype(np.uint32)
    x ^= key
    with np.errstate(over="ignore"):
        x ^= x >> _U32(16)
        x *= _U32(0x7FEB352D)
        x ^= x >> _U32(15)
        x *= _U32(0x846CA68B)
        x ^= x >> _U32(16)
    return x


def _key(*parts: object) -> np.uint32:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return _U32(int.from_bytes(digest, "little"))


def _uniform(key: np.uint32, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    """A uniform draw in (0, 1) per element index, a pure function of ``(key, index)``."""
    h = (_hash(key, idx) >> _U32(8)).astype(np.float32)
    h += np.float32(0.5)
    h *= np.float32(1.0 / (1 << 24))
    return h


def _normal(key: np.uint32, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    """A standard normal draw per element index (Box-Muller on two counter draws)."""
    u1 = _uniform(key, idx).astype(np.float64)
    u2 = _uniform(key ^ _U32(0x5851F42D), idx).astype(np.float64)
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)


def _round(values: npt.NDArray[np.float32], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(values).to(dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticRun:
    """Versions ``0, 1, 2, ...`` of a synthetic checkpoint of ``family`` under ``config``."""

    config: Mapping[str, Any]
    family: str
    seed: int = 0
    rate: float = 0.01
    rates: tuple[float, ...] = ()
    """Per-step rates: step ``k`` uses ``rates[(k - 1) % len(rates)]``; empty: ``rate``."""
    relative: float = 0.01
    std: float = 0.02
    dtype: torch.dtype = torch.bfloat16

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return canonical_shapes(dict(self.config), self.family)

    def values(self, name: str, idx: npt.NDArray[np.int64], version: int) -> torch.Tensor:
        """Elements ``idx`` (flat canonical indices) of tensor ``name`` at ``version``.

        Version 0 is uniform with standard deviation ``std`` (cheap to draw for large models);
        every later step is :meth:`step`.
        """
        w = _uniform(_key(self.seed, name, 0), idx)
        w -= np.float32(0.5)
        w *= np.float32(self.std * 12**0.5)
        if name.endswith("norm.weight"):
            w += np.float32(1.0)
        t = _round(w, self.dtype)
        for k in range(1, version + 1):
            self.step(name, idx, t, k)
        return t

    def step(self, name: str, idx: npt.NDArray[np.int64], t: torch.Tensor, k: int) -> None:
        """Move elements ``idx`` of ``name``, held in ``t`` at version ``k - 1``, to ``k``."""
        chosen = self._chosen(name, idx, k)
        if chosen.size:
            t[chosen] = self._moved(name, idx[chosen], t[chosen], k)

    def _chosen(self, name: str, idx: npt.NDArray[np.int64], k: int) -> npt.NDArray[np.int64]:
        """Positions in ``idx`` of the elements step ``k`` updates (hashed in cache-sized
        pieces: the hash's passes then stay in cache)."""
        threshold = _U32(min(int(self.rate_of(k) * 2**32), 2**32 - 1))
        key = _key(self.seed, name, k, "u")
        parts = [
            np.flatnonzero(_hash(key, idx[i : i + _HASH_BLOCK]) < threshold) + i
            for i in range(0, idx.size, _HASH_BLOCK)
        ]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _moved(
        self, name: str, idx: npt.NDArray[np.int64], old: torch.Tensor, k: int
    ) -> torch.Tensor:
        """Chosen elements ``idx`` of ``name`` at version ``k``, from their values ``old``."""
        eps = _normal(_key(self.seed, name, k, "e"), idx)
        scale = np.float32(1.0) + np.float32(self.relative) * eps
        return _round(old.to(torch.float32).numpy() * scale, self.dtype)

    def rate_of(self, k: int) -> float:
        """The element change rate of step ``k``."""
        return self.rates[(k - 1) % len(self.rates)] if self.rates else self.rate

    def advance(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Move a canonical ``state`` (or a subset of its tensors) from ``version - 1`` to
        ``version`` in place: one draw per element instead of replaying every step."""
        for name, t in state.items():
            flat = t.reshape(-1)
            for start in range(0, flat.numel(), _BLOCK):
                idx = np.arange(start, min(start + _BLOCK, flat.numel()), dtype=np.int64)
                self.step(name, idx, flat[start : start + idx.size], version)

    def tensor(self, name: str, version: int) -> torch.Tensor:
        """Canonical tensor ``name`` at ``version``."""
        shape = self.shapes[name]
        out = torch.empty(shape, dtype=self.dtype)
        flat = out.reshape(-1)
        for start in range(0, flat.numel(), _BLOCK):
            idx = np.arange(start, min(start + _BLOCK, flat.numel()), dtype=np.int64)
            flat[start : start + idx.size] = self.values(name, idx, version)
        return out

    def state(self, version: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The canonical state dict at ``version`` (or only ``names`` of it)."""
        chosen = list(self.shapes) if names is None else list(names)
        return {n: self.tensor(n, version) for n in chosen}

    def shard(self, spec: ShardSpec, version: int) -> torch.Tensor:
        """Training shard ``spec`` at ``version``, filled through its affine mapping (padding
        rows, which project nowhere, stay zero)."""
        assert spec.mapping is not None, "residual-only shards are not synthetic"
        out = torch.zeros(spec.shape, dtype=spec.dtype)
        flat = bits(out).reshape(-1)
        for start in range(0, flat.size, _BLOCK):
            local = np.arange(start, min(start + _BLOCK, flat.size), dtype=np.int64)
            for d in spec.mapping.project(local):
                src = local if d.select is None else local[d.select]
                flat[src] = bits(self.values(d.name, d.indices, version))
        return out

    def advance_shard(self, spec: ShardSpec, shard: torch.Tensor, version: int) -> None:
        """Move ``shard`` (held at ``version - 1``) to ``version`` in place: one optimizer
        step of the synthetic trainer, computed from the shard alone.  An element with several
        canonical destinations (a tied weight) follows its first one."""
        assert spec.mapping is not None, "residual-only shards are not synthetic"
        flat = shard.reshape(-1)
        for start in range(0, flat.numel(), _BLOCK):
            local = np.arange(start, min(start + _BLOCK, flat.numel()), dtype=np.int64)
            done: npt.NDArray[np.bool_] | None = None
            for d in spec.mapping.project(local):
                pos = np.arange(local.size) if d.select is None else d.select
                canon = d.indices
                if done is None:  # the first destination: every element is fresh
                    done = np.zeros(local.size, dtype=bool)
                else:
                    fresh = ~done[pos]
                    pos, canon = pos[fresh], canon[fresh]
                done[pos] = True
                chosen = self._chosen(d.name, canon, version)
                if chosen.size:  # only the chosen elements are read and written
                    src = torch.from_numpy(local[pos[chosen]])
                    flat[src] = self._moved(d.name, canon[chosen], flat[src], version)

    def shards(self, plan: TrainingPlan, rank: int, version: int) -> dict[str, torch.Tensor]:
        """Every shard training rank ``rank`` holds (it is one of the replicas), at ``version``."""
        return {s.key: self.shard(s, version) for s in held_by(plan, rank)}


def held_by(plan: TrainingPlan, rank: int) -> Iterator[ShardSpec]:
    """Shards whose replicas include ``rank``."""
    return (s for s in plan.shards if rank in s.replicas)
