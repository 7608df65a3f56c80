"""A sharded sharded receiver: one tensor-parallel rank of a vLLM-like model, in plain torch.

Scaffolding for tests, the demo and benchmarks.

:class:`ShardedServingModel` holds one rank's parameters in the fused, padded layout vLLM
uses for the ``llama``, ``qwen3`` and ``qwen3_moe`` families of :mod:`dcr.models.families`, and
:class:`ShardedServingLoader` loads canonical (Hugging Face) tensors into it the way vLLM's
weight loaders do: ``narrow`` views of the checkpoint tensor and one ``copy_`` per destination,
plus ``fill_(0)`` of vocabulary padding rows.  It lets the receiver data plane be tested at any
tensor-parallel size without vLLM:

* ``embed_tokens`` / ``lm_head``: vocabulary-parallel, padded to a multiple of ``64 * tp``;
  rank ``r`` holds padded rows ``[r*Vp/tp, (r+1)*Vp/tp)``; tied ``lm_head`` shares the
  embedding and ``lm_head.weight`` is a native skip;
* ``q/k/v_proj`` -> fused ``qkv_proj`` ``[q of this rank's heads; k; v]``, key/value heads
  replicated when ``num_key_value_heads < tp`` (rank ``r`` holds kv head ``r*nkv//tp``);
* ``gate/up_proj`` -> fused ``gate_up_proj`` (column-parallel); ``o_proj``/``down_proj``
  row-parallel;
* ``qwen3_moe`` experts -> ``w13_weight [E/tp, 2f, h]`` and ``w2_weight [E/tp, h, f]``, rank
  ``r`` holding experts ``[r*E/tp, (r+1)*E/tp)`` (others are native skips); router replicated;
* norms replicated; **transforming paths**: ``model.norm.weight`` is stored in float32 (a cast
  on copy) and any extra tensor named ``*A_log`` is stored as ``A = -exp(A_log.float())``;
* with ``fp8`` (an FP8 rollout, :mod:`dcr.tensors.fp8`), the fused projection weights hold
  ``float8_e4m3fn`` values and each has its ``float32`` scales beside it
  (``qkv_proj.weight_scale_inv`` for block scales, ``..._scale`` for channel scales), fused
  and split the way vLLM's FP8 linear layers hold them: block scales stacked along block rows,
  column-parallel scales split with their rows, row-parallel block scales split with their
  columns and channel scales of row-parallel weights whole on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dcr.apply.loader import Loader
from dcr.errors import LayoutError
from dcr.models.families import canonical_shapes, head_dim
from dcr.tensors.fp8 import FP8_DTYPE, SCALE_DTYPE, Fp8Scheme
from dcr.tensors.records import TensorSpec

__all__ = ["ShardedServingLoader", "ShardedServingModel", "padded_vocab"]

_VOCAB_PADDING = 64
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def padded_vocab(vocab: int, tp_size: int) -> int:
    """Vocabulary rows after padding to a multiple of ``64 * tp_size``."""
    unit = _VOCAB_PADDING * tp_size
    return -(-vocab // unit) * unit


def _divide(total: int, tp_size: int, what: str) -> int:
    if total % tp_size:
        raise LayoutError(f"{what}={total} is not divisible by tp_size={tp_size}")
    return total // tp_size


def _a_name(name: str) -> str:
    """Where an ``*A_log`` canonical tensor is stored: the same path ending in ``A``."""
    return name.removesuffix("A_log") + "A"


class ShardedServingModel(torch.nn.Module):
    """One tensor-parallel rank of a vLLM-like model of ``family`` (parameters only).

    ``extra`` adds canonical tensors the families lack (stored replicated), e.g. a Mamba-style
    ``...A_log`` that the loader transforms.  Parameters start at zero.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        family: str,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        extra: Mapping[str, TensorSpec] | None = None,
        fp8: Fp8Scheme | None = None,
    ) -> None:
        super().__init__()
        self.fp8 = fp8
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
        self.config = dict(config)
        self.family = family
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.dtype = dtype
        self.extra = dict(extra or {})
        self.canonical = canonical_shapes(self.config, family)

        c = self.config
        h = int(c["hidden_size"])
        nq = int(c["num_attention_heads"])
        nkv = int(c.get("num_key_value_heads", nq))
        self.head_dim = head_dim(self.config)
        self.q_heads = _divide(nq, tp_size, "num_attention_heads")
        if nkv >= tp_size:
            self.kv_heads = _divide(nkv, tp_size, "num_key_value_heads")
        elif tp_size % nkv:
            raise LayoutError(f"tp_size={tp_size} is not a multiple of num_key_value_heads={nkv}")
        else:
            self.kv_heads = 1
        self.ffn = _divide(int(c["intermediate_size"]), tp_size, "intermediate_size")
        self.vocab = int(c["vocab_size"])
        self.vocab_rows = padded_vocab(self.vocab, tp_size) // tp_size
        self.experts = int(c.get("num_experts") or 0)
        self.local_experts = _divide(self.experts, tp_size, "num_experts") if self.experts else 0
        self.tied = bool(c.get("tie_word_embeddings", False))

        hd = self.head_dim
        self._add("model.embed_tokens.weight", (self.vocab_rows, h))
        for i in range(int(c["num_hidden_layers"])):
            p = f"model.layers.{i}."
            self._add(p + "input_layernorm.weight", (h,))
            qkv_rows = (self.q_heads + 2 * self.kv_heads) * hd
            self._weight(p + "self_attn.qkv_proj.weight", (qkv_rows, h),
                         (self.q_heads * hd, self.kv_heads * hd))  # fmt: skip
            self._weight(p + "self_attn.o_proj.weight", (h, self.q_heads * hd), row_parallel=True)
            if p + "self_attn.q_norm.weight" in self.canonical:
                self._add(p + "self_attn.q_norm.weight", (hd,))
                self._add(p + "self_attn.k_norm.weight", (hd,))
            self._add(p + "post_attention_layernorm.weight", (h,))
            if p + "mlp.gate.weight" in self.canonical:
                f = int(c["moe_intermediate_size"])
                self._add(p + "mlp.gate.weight", (self.experts, h))
                self._weight(p + "mlp.experts.w13_weight", (self.local_experts, 2 * f, h), (f,))
                self._weight(p + "mlp.experts.w2_weight", (self.local_experts, h, f))
            else:
                self._weight(p + "mlp.gate_up_proj.weight", (2 * self.ffn, h), (self.ffn,))
                self._weight(p + "mlp.down_proj.weight", (h, self.ffn), row_parallel=True)
        self._add("model.norm.weight", (h,), torch.float32)
        if self.tied:
            self.lm_head = torch.nn.Module()
            self.lm_head.weight = self.get_parameter("model.embed_tokens.weight")
        else:
            self._add("lm_head.weight", (self.vocab_rows, h))
        for name, spec in self.extra.items():
            if name.endswith("A_log"):
                self._add(_a_name(name), spec.shape, torch.float32)
            else:
                self._add(name, spec.shape, spec.dtype)
        rope = torch.arange(0, hd, 2, dtype=torch.float32) / hd
        inv_freq = 1.0 / (float(c.get("rope_theta", 10000.0)) ** rope)
        self._submodule("model.rotary_emb").register_buffer("inv_freq", inv_freq, persistent=False)

    def _submodule(self, path: str) -> torch.nn.Module:
        module: torch.nn.Module = self
        for part in path.split("."):
            child = getattr(module, part, None)
            if not isinstance(child, torch.nn.Module):
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        return module

    def _weight(
        self,
        name: str,
        shape: tuple[int, ...],
        parts: tuple[int, ...] = (),
        *,
        row_parallel: bool = False,
    ) -> None:
        """A projection weight; with FP8, float8 values and the scales beside them (``parts``:
        row counts of the fused pieces, each a whole number of scale tiles)."""
        if self.fp8 is None:
            self._add(name, shape)
            return
        self._add(name, shape, FP8_DTYPE)
        *lead, rows, cols = shape
        b = self.fp8.block
        if b is None:
            full_rows = rows  # channel scales: one per output row, never split by columns
            scale = (*lead, full_rows, 1)
        else:
            for n in (*parts, rows):
                if n % b:
                    raise LayoutError(f"{n} rows of a fused piece of {name} are not whole "
                                      f"{b}x{b} tiles", check="fp8-tiles")  # fmt: skip
            if row_parallel and self.tp_size > 1 and cols % b:
                raise LayoutError(f"{cols} columns of {name} per rank are not whole {b}x{b} "
                                  "tiles", check="fp8-tiles")  # fmt: skip
            scale = (*lead, rows // b, -(-cols // b))
        self._add(name + ("_scale" if b is None else "_scale_inv"), scale, SCALE_DTYPE)

    def _add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        parent, _, leaf = name.rpartition(".")
        data = torch.zeros(shape, dtype=dtype or self.dtype)
        self._submodule(parent).register_parameter(
            leaf, torch.nn.Parameter(data, requires_grad=False)
        )

    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of this rank by name (tied names included), detached."""
        out = {n: p.detach() for n, p in self.named_parameters(remove_duplicate=False)}
        out.update((n, b.detach()) for n, b in self.named_buffers(remove_duplicate=False))
        return out


class ShardedServingLoader(Loader):
    """vLLM-style native loader of a :class:`ShardedServingModel`.

    ``load_weights`` takes canonical names and returns the names of the rank's parameters it
    wrote; unknown names and other ranks' experts are skipped without a report.
    """

    def __init__(self, model: ShardedServingModel) -> None:
        self._model = model
        self._params = dict(model.named_parameters(remove_duplicate=False))

    @property
    def module(self) -> ShardedServingModel:
        return self._model

    @classmethod
    def dense(
        cls,
        config: Mapping[str, Any],
        family: str,
        state_dict: Mapping[str, torch.Tensor],
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        extra: Mapping[str, TensorSpec] | None = None,
        fp8: Fp8Scheme | None = None,
    ) -> ShardedServingLoader:
        """Build one rank and dense-load ``state_dict`` into it."""
        model = ShardedServingModel(
            config, family, tp_size=tp_size, tp_rank=tp_rank, dtype=dtype, extra=extra, fp8=fp8
        )
        loader = cls(model)
        loader.dense_load(state_dict)
        return loader

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        with torch.no_grad():
            for name, w in weights:
                target = self._load_one(name, w)
                if target is not None:
                    loaded.add(target)
        return loaded

    def _param(self, name: str) -> torch.Tensor:
        return self._params[name].data

    def _load_one(self, name: str, w: torch.Tensor) -> str | None:
        m = self._model
        if name in m.extra:
            if name.endswith("A_log"):
                target = _a_name(name)
                self._param(target).copy_(-torch.exp(w.float()))
                return target
            self._param(name).copy_(w)
            return name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and m.tied:
                return None
            return self._vocab_parallel(name, w)
        if name == "model.norm.weight":
            self._param(name).copy_(w)
            return name
        layer = _LAYER.fullmatch(name)
        if layer is None:
            return None
        return self._layer(f"model.layers.{layer.group(1)}.", layer.group(2), w)

    def _vocab_parallel(self, name: str, w: torch.Tensor) -> str:
        m = self._model
        param = self._param(name)
        first = m.tp_rank * m.vocab_rows
        valid = max(0, min(m.vocab - first, m.vocab_rows))
        shard = w.narrow(0, min(first, m.vocab), valid)
        param[:valid].copy_(shard)
        param[valid:].fill_(0)
        return name

    def _layer(self, prefix: str, rest: str, w: torch.Tensor) -> str | None:
        m = self._model
        r, hd = m.tp_rank, m.head_dim
        if rest.endswith("norm.weight") or rest == "mlp.gate.weight":
            self._param(prefix + rest).copy_(w)
            return prefix + rest
        # FP8 scales land like their weights, rows (and columns) counted in scale tiles.
        suffix, unit, channel = "", 1, False
        if m.fp8 is not None:
            for end in ("_scale_inv", "_scale"):
                if rest.endswith(".weight" + end):
                    rest, suffix = rest.removesuffix(end), end
                    unit, channel = m.fp8.block or 1, m.fp8.block is None
        if rest in _QKV:
            target = prefix + "self_attn.qkv_proj.weight" + suffix
            q_rows, kv_rows = m.q_heads * hd // unit, m.kv_heads * hd // unit
            if rest.startswith("self_attn.q"):
                src, dst = w.narrow(0, r * q_rows, q_rows), (0, q_rows)
            else:
                nkv = int(m.config.get("num_key_value_heads", m.config["num_attention_heads"]))
                head = r * m.kv_heads if nkv >= m.tp_size else r * nkv // m.tp_size
                src = w.narrow(0, head * hd // unit, kv_rows)
                dst = (q_rows if rest.startswith("self_attn.k") else q_rows + kv_rows, kv_rows)
            self._param(target)[dst[0] : dst[0] + dst[1]].copy_(src)
            return target
        if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            target = prefix + rest + suffix
            cols = self._param(target).shape[1]
            self._param(target).copy_(w if channel else w.narrow(1, r * cols, cols))
            return target
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            target = prefix + "mlp.gate_up_proj.weight" + suffix
            ffn = m.ffn // unit
            offset = 0 if rest == "mlp.gate_proj.weight" else ffn
            self._param(target)[offset : offset + ffn].copy_(w.narrow(0, r * ffn, ffn))
            return target
        expert = _EXPERT.fullmatch(rest)
        if expert is None:
            return None
        local = int(expert.group(1)) - r * m.local_experts
        if not 0 <= local < m.local_experts:
            return None
        kind = expert.group(2)
        if kind == "down_proj":
            target = prefix + "mlp.experts.w2_weight" + suffix
            self._param(target)[local].copy_(w)
            return target
        target = prefix + "mlp.experts.w13_weight" + suffix
        f = w.shape[0]
        offset = 0 if kind == "gate_proj" else f
        self._param(target)[local, offset : offset + f].copy_(w)
        return target
