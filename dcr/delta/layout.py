"""Training layouts: Megatron-style shards, their mapping metadata and owner election.

:func:`build_plan` turns a canonical catalog (Hugging Face names, shapes, dtypes) plus an
HF-style config of the ``llama`` / ``qwen3`` / ``qwen3_moe`` families into the shards a
Megatron-Core trainer with the given TP / EP / DP would hold: fused QKV per query group,
``fc1 = [gate; up]`` per rank, row/column splits, experts across EP ranks and a vocabulary padded
to a TP-divisible size -- each shard with the affine mapping that projects it back to canonical
coordinates.  With ``family=None`` every tensor is :class:`~dcr.delta.mapping.Direct` (or
:class:`~dcr.delta.mapping.Replicated` across TP ranks).

Ranks are numbered ``rank = (dp_rank * ep + ep_rank) * tp + tp_rank``.  Dense parameters are
replicated across DP and EP (expert parallelism is carved out of data parallelism, as in
Megatron) and split across TP; routed experts are split across EP and, within an expert,
across TP.  One owner per replica group is elected by a stable name hash (paper §4.1, Fig. A.2),
so data-parallel copies are compared once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dcr.delta.fp8 import Fp8Region, RegionBlock
from dcr.delta.fp8_shared import SharedTiles
from dcr.delta.mapping import (
    AffineMapping,
    ColumnParallel,
    Direct,
    FusedQKV,
    GatedMLP,
    PerExpert,
    Replicated,
    RowParallel,
    Tied,
)
from dcr.delta.residual import ResidualTask
from dcr.errors import ConfigError, LayoutError
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import Fp8Scheme, quantized_names, rollout_catalog
from dcr.tensors.records import TensorSpec

__all__ = [
    "FAMILIES",
    "ShardSpec",
    "TrainLayout",
    "TrainingPlan",
    "build_plan",
    "stable_hash",
]

FAMILIES = ("llama", "qwen3", "qwen3_moe")


def stable_hash(name: str) -> int:
    """A hash of ``name`` that is the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainLayout:
    """Parallel layout of the training side.

    ``world_size = dp * ep * tp`` ranks.  ``vocab_divisible_by`` mirrors Megatron's
    ``make_vocab_size_divisible_by``: the vocabulary is padded to a multiple of
    ``vocab_divisible_by * tp``.
    """

    tp: int = 1
    ep: int = 1
    dp: int = 1
    vocab_divisible_by: int = 128

    def __post_init__(self) -> None:
        for f in ("tp", "ep", "dp", "vocab_divisible_by"):
            if getattr(self, f) < 1:
                raise ConfigError(f"TrainLayout.{f} must be >= 1, got {getattr(self, f)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.ep * self.tp

    def rank(self, *, dp: int, ep: int, tp: int) -> int:
        return (dp * self.ep + ep) * self.tp + tp

    def padded_vocab(self, vocab: int) -> int:
        m = self.vocab_divisible_by * self.tp
        return -(-vocab // m) * m


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ShardSpec:
    """One training shard (a source shard): where it lives, who owns it, how it projects.

    ``key`` is unique in the plan.  ``replicas`` are the ranks holding bitwise-identical
    copies; ``owner`` is the one that compares and projects it.  ``mapping`` is ``None`` for a
    shard that only feeds residual conversions.
    """

    key: str
    source_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mapping: AffineMapping | None
    replicas: tuple[int, ...]
    owner: int
    tp_rank: int = 0
    ep_rank: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Extract = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TrainingPlan:
    """Every shard of a training layout, with the canonical catalog it projects to."""

    layout: TrainLayout
    family: str | None
    catalog: Mapping[str, TensorSpec]
    shards: tuple[ShardSpec, ...]
    residual: tuple[ResidualTask, ...] = ()
    fp8: Fp8Scheme | None = None
    """The FP8 rollout scheme: receivers hold each weight of :attr:`quantized` as FP8 values
    and scales (:mod:`dcr.delta.fp8`); ``None``: receivers hold the catalog as it is."""
    quantized: frozenset[str] = frozenset()
    """The canonical weights an FP8 rollout quantizes (:func:`~dcr.tensors.fp8.quantized_names`)."""
    _by_key: dict[str, ShardSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_key: dict[str, ShardSpec] = {}
        for s in self.shards:
            if s.key in by_key:
                raise LayoutError(f"duplicate shard key {s.key!r}")
            by_key[s.key] = s
        object.__setattr__(self, "_by_key", by_key)
        for task in self.residual:
            if task.name not in self.catalog:
                raise LayoutError("residual task outside the catalog", tensor=task.name)
            for key in task.inputs:
                if key not in by_key:
                    raise LayoutError(
                        f"residual input shard {key!r} is not in the plan", tensor=task.name
                    )

    def __getitem__(self, key: str) -> ShardSpec:
        return self._by_key[key]

    @property
    def wire_catalog(self) -> dict[str, TensorSpec]:
        """What receivers hold: the catalog, with each quantized weight as its FP8 values (same
        name) followed by its scales (:func:`~dcr.tensors.fp8.rollout_catalog`)."""
        if self.fp8 is None:
            return dict(self.catalog)
        return rollout_catalog(self.catalog, self.fp8, self.quantized)

    def fp8_regions(self, rank: int) -> dict[str, tuple[Fp8Region, list[RegionBlock]]]:
        """For each quantized weight that ``rank``'s shards project: the region of its tiles
        this rank owns, and the shard blocks that fill it.  A region that is not one rectangle
        is refused (:class:`LayoutError`, ``check="fp8-tiles"``); tiles it shares with other
        owners are listed by :meth:`fp8_shared_tiles`.
        """
        if self.fp8 is None:
            return {}
        found: dict[str, list[RegionBlock]] = {}
        for s in self.owned_by(rank):
            if s.mapping is None or not self.quantized.intersection(s.mapping.names):
                continue
            canon = {n: torch.empty(self.catalog[n].shape, dtype=s.dtype, device="meta")
                     for n in s.mapping.names}  # fmt: skip
            probe = torch.empty(s.shape, dtype=s.dtype, device="meta")
            for name, cview, sview in s.mapping.blocks(canon, probe):
                if name in self.quantized:
                    found.setdefault(name, []).extend(RegionBlock.of(s.key, cview, sview))
        out = {}
        for name, blocks in found.items():
            shape = self.catalog[name].shape
            r0, r1 = min(b.rows[0] for b in blocks), max(b.rows[1] for b in blocks)
            c0, c1 = min(b.cols[0] for b in blocks), max(b.cols[1] for b in blocks)
            area = sum((b.rows[1] - b.rows[0]) * (b.cols[1] - b.cols[0]) for b in blocks)
            if area != (r1 - r0) * (c1 - c0):
                raise LayoutError(f"rank {rank}'s shards of this weight are not one rectangle of "
                                  "tiles", tensor=name, check="fp8-tiles")  # fmt: skip
            region = Fp8Region(name, (int(shape[0]), int(shape[1])), (r0, r1), (c0, c1))
            region.check(self.fp8)
            out[name] = (region, blocks)
        return out

    def fp8_shared_tiles(self) -> SharedTiles:
        """The FP8 tiles several owners share -- rows of a row-parallel weight under
        per-channel scales, block tiles that shards cut -- as the slots of every such weight's
        tile grid, in catalog order (:mod:`dcr.delta.fp8_shared`)."""
        grids: dict[str, tuple[int, int]] = {}
        if self.fp8 is not None:
            for rank in self.owners:
                for name, (region, _) in self.fp8_regions(rank).items():
                    if region.shares_tiles(self.fp8):
                        grids[name] = self.fp8.tile_grid(region.shape)
        fp8 = self.fp8 or Fp8Scheme()
        return SharedTiles(fp8, {n: grids[n] for n in self.catalog if n in grids})

    def with_fp8(self, fp8: Fp8Scheme | None) -> TrainingPlan:
        """This plan with the FP8 rollout ``fp8`` (``None``: receivers hold the catalog as it
        is).  Every owner's regions are checked (:meth:`fp8_regions`): a layout whose shards cut
        tiles raises :class:`LayoutError` here, before anything is built."""
        if fp8 == self.fp8:
            return self
        quantized: frozenset[str] = frozenset()
        if fp8 is not None:
            shapes = {n: s.shape for n, s in self.catalog.items() if s.dtype == torch.bfloat16}
            quantized = frozenset(quantized_names(shapes))
            if not quantized:
                raise LayoutError("an FP8 rollout needs bfloat16 projection weights; the "
                                  "catalog has none", check="fp8")  # fmt: skip
        plan = dataclasses.replace(self, fp8=fp8, quantized=quantized)
        for rank in plan.owners:
            plan.fp8_regions(rank)
        return plan

    def residual_owner(self, name: str) -> int:
        """The rank that holds the residual baseline of canonical tensor ``name``."""
        return stable_hash(name) % self.layout.world_size

    @property
    def residual_inputs(self) -> frozenset[str]:
        """Shard keys that feed at least one residual task."""
        return frozenset(k for t in self.residual for k in t.inputs)

    def validate_coverage(self) -> None:
        """Check that affine shards and residual tasks cover every canonical element once.

        Raises :class:`LayoutError` naming the first tensor with an element covered zero or
        several times.
        """
        counts = {n: torch.zeros(s.shape, dtype=torch.uint8) for n, s in self.catalog.items()}
        for s in self.shards:
            if s.mapping is None:
                continue
            probe = torch.empty(s.shape, dtype=torch.uint8)
            for _, canon, _ in s.mapping.blocks(counts, probe):
                canon.add_(1)
        for task in self.residual:
            counts[task.name].add_(1)
        for name, c in counts.items():
            if c.numel() and not bool((c == 1).all()):
                raise LayoutError(
                    f"{int((c == 0).sum())} elements uncovered, {int((c > 1).sum())} covered "
                    "more than once",
                    tensor=name,
                    check="coverage",
                )

    @property
    def owners(self) -> tuple[int, ...]:
        """Ranks that own at least one shard, ascending."""
        return tuple(sorted({s.owner for s in self.shards}))

    def owned_by(self, rank: int) -> list[ShardSpec]:
        return [s for s in self.shards if s.owner == rank]

    def slice(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Dense slicing of a canonical state dict into this plan's shard tensors.

        Shards are contiguous copies (views where the slice already is one); vocabulary
        padding rows are zero.  Missing or misshapen tensors raise :class:`LayoutError`.
        """
        for name, spec in self.catalog.items():
            t = state_dict.get(name)
            if t is None:
                raise LayoutError("tensor missing from the state dict", tensor=name)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise LayoutError(
                    f"expected {spec.dtype}{list(spec.shape)}, got {t.dtype}{list(t.shape)}",
                    tensor=name,
                    check="shape",
                )
        out: dict[str, torch.Tensor] = {}
        for s in self.shards:
            if s.mapping is None:
                raise LayoutError("shard has no mapping to slice with", tensor=s.key)
            out[s.key] = _slice_one(s.mapping, s.dtype, state_dict)
        return out

    def check_shards(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise :class:`LayoutError` unless ``shards`` has every shard with its shape/dtype."""
        for s in self.shards:
            t = shards.get(s.key)
            if t is None:
                raise LayoutError("shard missing", tensor=s.key)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise LayoutError(
                    f"expected {s.dtype}{list(s.shape)}, got {t.dtype}{list(t.shape)}",
                    tensor=s.key,
                    check="shape",
                )


def _slice_one(
    mapping: AffineMapping, dtype: torch.dtype, sd: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    if isinstance(mapping, Direct):
        t = sd[mapping.name]
        return t if t.is_contiguous() else t.contiguous()
    probe = torch.empty(mapping.source_shape, dtype=dtype, device="meta")
    pairs = mapping.source_blocks(sd, probe)
    if len(pairs) == 1 and pairs[0][2].shape == probe.shape and pairs[0][1].is_contiguous():
        return pairs[0][1]
    # Rows without a canonical source (vocabulary padding) are zero; skip the zero fill when
    # the blocks cover the whole shard (fresh pages are slow to touch twice).
    covered = sum(local.numel() for _, _, local in pairs)
    shard = (torch.empty if covered == probe.numel() else torch.zeros)(
        mapping.source_shape, dtype=dtype
    )
    for _, canon, local in mapping.source_blocks(sd, shard):
        np.copyto(bits(local), bits(canon))  # numpy: no intra-op thread wake-ups per block
    return shard


# --------------------------------------------------------------------------- family rules

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _cfg(config: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    if config is None or (key not in config and default is None):
        raise ConfigError(f"config needs {key!r} for this family")
    return config.get(key, default)


class _Builder:
    """Accumulates shard specs for one plan; elects owners as shards are added."""

    def __init__(self, layout: TrainLayout, catalog: Mapping[str, TensorSpec]) -> None:
        self.layout = layout
        self.catalog = catalog
        self.shards: list[ShardSpec] = []
        self.used: set[str] = set()

    def dense_replicas(self, tp_rank: int) -> tuple[int, ...]:
        lay = self.layout
        return tuple(lay.rank(dp=d, ep=e, tp=tp_rank) for d in range(lay.dp) for e in range(lay.ep))

    def expert_replicas(self, ep_rank: int, tp_rank: int) -> tuple[int, ...]:
        lay = self.layout
        return tuple(lay.rank(dp=d, ep=ep_rank, tp=tp_rank) for d in range(lay.dp))

    def add(
        self,
        source_name: str,
        mapping: AffineMapping,
        replicas: tuple[int, ...],
        *,
        tp_rank: int = 0,
        ep_rank: int | None = None,
        suffix: str = "",
    ) -> None:
        names = mapping.names
        dtype = self.catalog[names[0]].dtype
        for n in names:
            if self.catalog[n].dtype != dtype:
                raise LayoutError("fused tensors must share one dtype", tensor=n, check="dtype")
        owner = replicas[stable_hash(source_name) % len(replicas)]
        self.shards.append(
            ShardSpec(
                key=source_name + suffix,
                source_name=source_name,
                shape=mapping.source_shape,
                dtype=dtype,
                mapping=mapping,
                replicas=replicas,
                owner=owner,
                tp_rank=tp_rank,
                ep_rank=ep_rank,
            )
        )
        self.used.update(names)

    def replicated(self, source_name: str, canonical: str) -> None:
        """A tensor every rank holds whole (norms, routers, unknown tensors)."""
        spec = self.catalog[canonical]
        lay = self.layout
        mapping: AffineMapping
        if lay.tp == 1:
            mapping = Direct(canonical, spec.shape)
        else:
            mapping = Replicated(canonical, spec.shape)
        self.add(source_name, mapping, tuple(range(lay.world_size)))

    def column(
        self,
        source_name: str,
        canonical: str,
        padded: int | None = None,
        also: tuple[str, ...] = (),
    ) -> None:
        spec = self.catalog[canonical]
        tp = self.layout.tp
        for r in range(tp):
            mapping: AffineMapping = ColumnParallel(canonical, spec.shape, r, tp, padded)
            if also:
                mapping = Tied(mapping, also)
            self.add(source_name, mapping, self.dense_replicas(r), tp_rank=r, suffix=f"@tp{r}")

    def row(self, source_name: str, canonical: str) -> None:
        spec = self.catalog[canonical]
        if len(spec.shape) != 2:
            raise LayoutError("row-parallel tensors must be 2-D", tensor=canonical)
        tp = self.layout.tp
        for r in range(tp):
            shape2 = (spec.shape[0], spec.shape[1])
            self.add(
                source_name,
                RowParallel(canonical, shape2, r, tp),
                self.dense_replicas(r),
                tp_rank=r,
                suffix=f"@tp{r}",
            )


def _require(catalog: Mapping[str, TensorSpec], *names: str) -> None:
    for n in names:
        if n not in catalog:
            raise LayoutError("tensor the family layout needs is missing", tensor=n)


def build_plan(
    catalog: Mapping[str, TensorSpec],
    layout: TrainLayout,
    *,
    family: str | None = None,
    config: Mapping[str, Any] | None = None,
    fp8: Fp8Scheme | None = None,
) -> TrainingPlan:
    """The training shards of ``layout`` for a canonical ``catalog``.

    ``family`` selects Megatron's fused layouts (see the module docstring); canonical tensors
    that no family rule claims are replicated whole.  A tied-embedding model may omit
    ``lm_head.weight``; when both are present and ``tie_word_embeddings`` is set, the embedding
    shard projects to both.  ``fp8`` makes the rollout checkpoint FP8: its BF16 projection
    weights reach receivers as FP8 values and scales (:attr:`TrainingPlan.wire_catalog`), and
    every owner's regions of them are checked here (:meth:`TrainingPlan.fp8_regions`).
    """
    b = _Builder(layout, catalog)
    if family is None:
        if layout.ep != 1:
            raise LayoutError("expert parallelism needs a family with experts (qwen3_moe)")
        for name in catalog:
            b.replicated(name, name)
    else:
        if family not in FAMILIES:
            raise ConfigError(f"unknown family {family!r}; expected one of {FAMILIES} or None")
        _family(b, family, config)
        for name in catalog:
            if name not in b.used:
                b.replicated(name, name)
    plan = TrainingPlan(layout=layout, family=family, catalog=dict(catalog),
                        shards=tuple(b.shards))  # fmt: skip
    return plan.with_fp8(fp8)


def _family(b: _Builder, family: str, config: Mapping[str, Any] | None) -> None:
    cat = b.catalog
    lay = b.layout
    tp = lay.tp
    tied = bool(_cfg(config, "tie_word_embeddings", False))
    vocab = int(_cfg(config, "vocab_size"))
    heads = int(_cfg(config, "num_attention_heads"))
    kv_heads = int(_cfg(config, "num_key_value_heads", heads))
    hidden = int(_cfg(config, "hidden_size"))
    hd = config.get("head_dim") if config else None
    head_dim = int(hd) if hd else hidden // heads
    layers = int(_cfg(config, "num_hidden_layers"))

    emb = "model.embed_tokens.weight"
    _require(cat, emb)
    if cat[emb].shape[0] != vocab:
        raise LayoutError(f"vocab_size {vocab} != embedding rows", tensor=emb, check="shape")
    padded = lay.padded_vocab(vocab)
    also = ("lm_head.weight",) if tied and "lm_head.weight" in cat else ()
    b.column("embedding.word_embeddings.weight", emb, padded, also)
    if not tied and "lm_head.weight" in cat:
        b.column("output_layer.weight", "lm_head.weight", padded)
    if "model.norm.weight" in cat:
        b.replicated("decoder.final_layernorm.weight", "model.norm.weight")

    for i in range(layers):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        q, k, v = (p + f"self_attn.{x}_proj.weight" for x in "qkv")
        _require(cat, q, k, v)
        for r in range(tp):
            qkv = FusedQKV(q, k, v, heads, kv_heads, head_dim, cat[q].shape[1:], r, tp)
            b.add(
                m + "self_attention.linear_qkv.weight",
                qkv,
                b.dense_replicas(r),
                tp_rank=r,
                suffix=f"@tp{r}",
            )
        if all(p + f"self_attn.{x}_proj.bias" in cat for x in "qkv"):
            qb, kb, vb = (p + f"self_attn.{x}_proj.bias" for x in "qkv")
            for r in range(tp):
                qkv = FusedQKV(qb, kb, vb, heads, kv_heads, head_dim, (), r, tp)
                b.add(
                    m + "self_attention.linear_qkv.bias",
                    qkv,
                    b.dense_replicas(r),
                    tp_rank=r,
                    suffix=f"@tp{r}",
                )
        b.row(m + "self_attention.linear_proj.weight", p + "self_attn.o_proj.weight")
        for src, dst in (
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ):
            if p + dst in cat:
                b.replicated(m + src, p + dst)
        if p + "mlp.gate.weight" in cat:
            _moe_layer(b, i, config)
        else:
            g, u, d = (p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
            _require(cat, g, u, d)
            for r in range(tp):
                b.add(
                    m + "mlp.linear_fc1.weight",
                    GatedMLP(g, u, cat[g].shape, r, tp),
                    b.dense_replicas(r),
                    tp_rank=r,
                    suffix=f"@tp{r}",
                )
            b.row(m + "mlp.linear_fc2.weight", d)
            if p + "post_attention_layernorm.weight" in cat:
                b.replicated(
                    m + "mlp.linear_fc1.layer_norm_weight", p + "post_attention_layernorm.weight"
                )
    if lay.ep != 1 and not any(s.ep_rank is not None for s in b.shards):
        raise LayoutError(f"ep={lay.ep} but the {family} model has no routed experts")


def _moe_layer(b: _Builder, i: int, config: Mapping[str, Any] | None) -> None:
    cat = b.catalog
    lay = b.layout
    p = f"model.layers.{i}."
    m = f"decoder.layers.{i}."
    experts = int(_cfg(config, "num_experts"))
    if experts % lay.ep:
        raise LayoutError(f"{experts} experts do not split over ep={lay.ep}", check="divisibility")
    per_rank = experts // lay.ep
    b.replicated(m + "mlp.router.weight", p + "mlp.gate.weight")
    if p + "post_attention_layernorm.weight" in cat:
        b.replicated(m + "pre_mlp_layernorm.weight", p + "post_attention_layernorm.weight")
    for e in range(lay.ep):
        for local in range(per_rank):
            ge = PerExpert.global_index(e, lay.ep, experts, local)
            x = p + f"mlp.experts.{ge}."
            g, u, d = x + "gate_proj.weight", x + "up_proj.weight", x + "down_proj.weight"
            _require(cat, g, u, d)
            src = m + f"mlp.experts.local_experts.{local}."
            for r in range(lay.tp):
                fc1 = PerExpert(GatedMLP(g, u, cat[g].shape, r, lay.tp), e, lay.ep, experts, local)
                fc2 = PerExpert(
                    RowParallel(d, (cat[d].shape[0], cat[d].shape[1]), r, lay.tp),
                    e,
                    lay.ep,
                    experts,
                    local,
                )
                reps = b.expert_replicas(e, r)
                sfx = f"@ep{e}.tp{r}"
                b.add(src + "linear_fc1.weight", fc1, reps, tp_rank=r, ep_rank=e, suffix=sfx)
                b.add(src + "linear_fc2.weight", fc2, reps, tp_rank=r, ep_rank=e, suffix=sfx)


def iter_ranks(layout: TrainLayout) -> Iterator[tuple[int, int, int, int]]:
    """``(rank, dp_rank, ep_rank, tp_rank)`` for every rank of ``layout``."""
    for d in range(layout.dp):
        for e in range(layout.ep):
            for t in range(layout.tp):
                yield layout.rank(dp=d, ep=e, tp=t), d, e, t
