"""Megatron-Core trainers as the source, through Megatron-Bridge's mapping registry.

Megatron-Bridge knows how every parameter of a Megatron-Core model maps to Hugging Face
checkpoint tensors: one mapping object per parameter (its conversion task), carrying the
parameter's tensor-/expert-parallel ranks and, for fused layouts, the model configuration
(paper App. A.1, App. C "Training side").  :class:`MegatronSource` reads each rank's own
parameters and translates the Bridge's mapping of each into dcr's tasks, with no
model-specific rule of its own:

* **affine**, where the mapping is one of the Bridge's element-wise classes -- ``Direct``,
  ``Replicated``, ``ColumnParallel``, ``RowParallel``, ``Auto`` mappings that permute no
  dimension (resolved by the Bridge's own module detection), ``GatedMLP`` (``[gate; up]`` per
  rank) and ``QKV`` (query groups ``[q heads, k, v]``, a per-element permutation) -- for dense
  parameters and for experts (per-expert and grouped-GEMM expert parameters, the global expert
  index taken from the Bridge's global parameter name), with padded vocabularies and tied
  embeddings.  The class test is exact: a subclass may override the conversion (a
  zero-centred norm adds one), so it is not trusted to be element-wise;
* **residual** otherwise (custom or fused-expert mappings, export hooks, permuted dimensions,
  FSDP-sharded modules): the tensor is converted by the Bridge's own export
  (``AutoBridge.export_hf_weights`` restricted to those conversion tasks, which gathers over
  the trainer's TP/EP/PP groups like the full export), then compared bitwise with its residual
  baseline, and its changed elements travel as overwrite records.  Every rank must agree on
  which tasks are residual, since the conversion is collective: an all-reduce settles it.

Canonical coordinates are those of the Hugging Face checkpoint.  Megatron may pad the
vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``; the Bridge exports the padded
rows as they are held, while the checkpoint has ``vocab_size`` rows, so rows of the model's
padded vocabulary at or beyond ``vocab_size`` (rows no token reaches) are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcr.adapters.sources.sharded import LocalShard, RankSource
from dcr.delta.layout import TrainLayout
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
from dcr.errors import ConfigError, DcrError, LayoutError
from dcr.tensors.records import TensorSpec

__all__ = ["MegatronSource", "Translation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Translation:
    """How one Megatron parameter became dcr tasks: affine (with its mapping class) or
    residual (with the reason the Bridge's mapping was not provably element-wise)."""

    param: str
    bridge_mapping: str
    affine: str | None
    reason: str | None = None


def _param_mapping() -> Any:
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping


class MegatronSource(RankSource):
    """This rank's shards of a Megatron-Core model, mapped through Megatron-Bridge.

    ``model`` is the rank's model chunks (a module or a list, wrapped or not); ``bridge`` an
    ``AutoBridge`` (``AutoBridge.from_hf_config(config)`` needs no weights).  ``vocab_size``
    is the canonical vocabulary (default: the Hugging Face config's).  Construction is
    collective over ``group`` (default: the default group; gloo for CPU tensors), whose ranks
    number the plan's ranks, and over Megatron's own model-parallel groups (the Bridge's
    conversion of residual tensors).  :attr:`translations` says what became affine and what
    residual.  The affine shards are the live parameters (copied to the CPU from a GPU):
    stage a version, then step the optimizer only after the transition ends (paper App. A.1
    "Fixed state").
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        bridge: Any,
        *,
        group: dist.ProcessGroup | None = None,
        vocab_size: int | None = None,
        validate: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("MegatronSource needs an initialised torch.distributed group")
        from megatron.core.utils import unwrap_model

        self.chunks = list(model) if isinstance(model, Sequence) else [model]
        self.bridge = bridge
        models = self.chunks
        base = unwrap_model(models)
        config = base[0].config
        hf = bridge.hf_pretrained
        hf_config = getattr(hf, "config", hf)
        self.vocab_size = (
            vocab_size if vocab_size is not None else getattr(hf_config, "vocab_size", None)
        )
        self.padded_vocab = getattr(base[0], "vocab_size", None)
        model_bridge = bridge._model_bridge  # the object export_hf_weights converts with
        for chunk in base:
            for name, _ in chunk.named_parameters():
                if model_bridge._is_adapter_param_name(name):
                    raise ConfigError(
                        "models with adapters (LoRA) are not supported: the export merges them",
                        tensor=name,
                    )
        tasks = model_bridge.build_conversion_tasks(hf, models)
        self._tasks = tasks
        counts = [
            torch.tensor([len(tasks)], dtype=torch.int64) for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(counts, torch.tensor([len(tasks)], dtype=torch.int64), group=group)
        if len({int(c.item()) for c in counts}) != 1:
            raise LayoutError(
                f"ranks built different numbers of conversion tasks: {[int(c) for c in counts]}",
                check="tasks",
            )
        tied = (
            model_bridge.mapping_registry()
            if getattr(config, "share_embeddings_and_output_weights", False)
            else None
        )
        local: dict[int, list[LocalShard]] = {}
        reasons: dict[int, str] = {}
        for i, task in enumerate(tasks):
            if task is None or task.param_weight is None or task.megatron_module is None:
                continue
            if model_bridge._should_skip_mtp_duplicate_embedding_export(task, models):
                continue
            also: tuple[str, ...] = ()
            if tied is not None:
                name = model_bridge._get_tied_output_hf_name(task, tied)
                if name is not None and _exports_tied(hf, name):
                    also = (name,)
            try:
                local[i] = self._translate(task, config, also)
            except _Residual as exc:
                reasons[i] = exc.message
        # The Bridge's conversion is collective: a task residual on any rank is residual on all.
        flags = torch.tensor([int(i in reasons) for i in range(len(tasks))], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        self._residual = [i for i, f in enumerate(flags.tolist()) if f and tasks[i] is not None]
        self.translations: list[Translation] = []
        """What each of this rank's parameters became (affine with its class, or residual)."""
        for i, task in enumerate(tasks):
            if i in local and i not in self._residual:
                affine = "+".join(sorted({_kind(s.mapping) for s in local[i]}))
                reason = None
            elif i in local or i in reasons:
                affine, reason = None, reasons.get(i, "residual on another rank")
                local.pop(i, None)
            else:
                continue
            self.translations.append(
                Translation(
                    param=task.global_param_name,
                    bridge_mapping=type(task.mapping).__name__,
                    affine=affine,
                    reason=reason,
                )
            )
        tp = _size("get_tensor_model_parallel_world_size")
        ep = _size("get_expert_model_parallel_world_size")
        world = dist.get_world_size(group)
        layout = (
            TrainLayout(tp=tp, ep=ep, dp=world // (tp * ep))
            if world % (tp * ep) == 0
            else TrainLayout(dp=world)
        )
        super().__init__(
            [s for shards in local.values() for s in shards],
            self._convert(),
            layout=layout,
            group=group,
            validate=validate,
        )

    @property
    def residual_tasks(self) -> int:
        """Conversion tasks that go through residual conversion."""
        return len(self._residual)

    def _convert(self) -> Mapping[str, torch.Tensor]:
        """The residual tensors now, converted by the Bridge's export of their tasks
        (collective: every rank runs it for the same tasks, in the same order)."""
        if not self._residual:
            return {}
        out = {}
        for name, t in self.bridge.export_hf_weights(
            self.chunks,
            cpu=True,
            show_progress=False,
            conversion_tasks=[self._tasks[i] for i in self._residual],
        ):
            t = t.detach().contiguous()
            if self._pads(t.shape[0] if t.dim() else 0):
                t = t[: self.vocab_size].contiguous()
            out[name] = t
        return out

    def _pads(self, rows: int) -> bool:
        """Whether a tensor of ``rows`` rows is a padded vocabulary whose padding is dropped."""
        return (
            self.vocab_size is not None
            and self.padded_vocab is not None
            and rows == self.padded_vocab
            and self.vocab_size < rows
        )

    # ------------------------------------------------------------------ translation

    def _translate(self, task: Any, config: Any, also: tuple[str, ...]) -> list[LocalShard]:
        """The affine shard(s) of one conversion task, or :class:`_Residual`."""
        pm = _param_mapping()
        mapping = task.mapping
        module = task.megatron_module
        param = task.param_weight
        kind = type(mapping)
        from torch.distributed.tensor import DTensor

        if isinstance(param, DTensor) or pm._module_uses_fsdp(module):
            raise _Residual("FSDP-sharded parameter")
        if task.export_hook is not None:
            raise _Residual("export hook")
        if getattr(mapping, "is_grouped_export", False):
            raise _Residual("grouped export (stacked experts)")
        if getattr(task, "weight_dtype", None) is not None:
            raise _Residual("export cast")
        shape = tuple(param.shape)
        dtype = param.dtype
        tp_rank, tp_size = int(mapping.tp_rank), int(mapping.tp_size)
        if kind is pm.AutoMapping:
            if mapping.permute_dims is not None:
                raise _Residual("permuted dimensions")
            detected = mapping._detect_parallelism_type(module)
            kind = {
                "column": pm.ColumnParallelMapping,
                "row": pm.RowParallelMapping,
                "replicated": pm.ReplicatedMapping,
            }[detected]
        name = mapping.hf_param
        expert = bool(mapping.is_expert)
        split = False
        inner: AffineMapping
        if kind in (pm.DirectMapping, pm.ReplicatedMapping) or (
            kind is pm.RowParallelMapping and len(shape) == 1
        ):
            inner = Replicated(name, shape) if tp_size > 1 else Direct(name, shape)
        elif kind is pm.ColumnParallelMapping:
            if not shape:
                raise _Residual("a scalar cannot be split")
            rows = shape[0] * tp_size
            if self._pads(rows):
                canonical = (self.vocab_size, *shape[1:])
                inner = ColumnParallel(name, canonical, tp_rank, tp_size, padded_rows=rows)
            else:
                inner = ColumnParallel(name, (rows, *shape[1:]), tp_rank, tp_size)
            split = tp_size > 1
        elif kind is pm.RowParallelMapping:
            if len(shape) != 2:
                raise _Residual(f"row-parallel tensor of {len(shape)} dimensions")
            inner = RowParallel(name, (shape[0], shape[1] * tp_size), tp_rank, tp_size)
            split = tp_size > 1
        elif kind is pm.GatedMLPMapping:
            if not shape or shape[0] % 2:
                raise _Residual("odd fused gate/up rows")
            canonical = (shape[0] // 2 * tp_size, *shape[1:])
            inner = GatedMLP(name["gate"], name["up"], canonical, tp_rank, tp_size)
            split = tp_size > 1
        elif kind is pm.QKVMapping:
            inner = self._qkv(mapping, module, shape, tp_rank, tp_size)
            split = tp_size > 1
        else:
            raise _Residual(f"{type(mapping).__name__} is not an element-wise class")
        if inner.source_shape != shape:
            raise _Residual(
                f"{type(inner).__name__} expects {list(inner.source_shape)}, the shard is "
                f"{list(shape)}"
            )
        catalog = _canonical(inner, dtype)
        ep_rank = None
        if expert:
            inner, ep_rank = self._expert(task, inner, config)
            if int(mapping.ep_size) > 1 and any(1 in c.shape for c in catalog):
                # The Bridge's EP gather squeezes every unit dimension of expert tensors.
                raise _Residual("expert tensor with a unit dimension")
        if also:
            if len(inner.names) != 1:
                raise _Residual("tied weight of a fused mapping")
            inner = Tied(inner, also)
            catalog = catalog + tuple(
                TensorSpec(name=a, shape=catalog[0].shape, dtype=dtype) for a in also
            )
        key = task.global_param_name + (f"@tp{tp_rank}" if split else "")
        return [
            LocalShard(
                key=key,
                source_name=task.global_param_name,
                read=param.detach,
                mapping=inner,
                catalog=catalog,
                tp_rank=tp_rank if split else 0,
                ep_rank=ep_rank,
            )
        ]

    def _qkv(
        self, mapping: Any, module: Any, shape: tuple[int, ...], tp_rank: int, tp_size: int
    ) -> AffineMapping:
        cfg = mapping._get_config(module)
        if mapping._tp_mapping._detect_parallelism_type(module) != "column":
            raise _Residual("QKV projection that is not column-parallel")
        if getattr(cfg, "attention_output_gate", False):
            raise _Residual("gated attention output (q and z interleaved)")
        heads = int(cfg.num_attention_heads)
        groups = int(cfg.num_query_groups or heads)
        head_dim = int(cfg.kv_channels or cfg.hidden_size // heads)
        if len(shape) == 2 and shape[1] != cfg.hidden_size:
            raise _Residual("QKV tensor in a scale domain")
        names = mapping.hf_param
        try:
            return FusedQKV(
                names["q"],
                names["k"],
                names["v"],
                heads,
                groups,
                head_dim,
                shape[1:],
                tp_rank,
                tp_size,
            )
        except LayoutError as exc:
            raise _Residual(str(exc)) from exc

    def _expert(self, task: Any, inner: AffineMapping, config: Any) -> tuple[AffineMapping, int]:
        """``inner`` as expert ``g`` of the Bridge's global name, checked against EP math."""
        from megatron.bridge.utils.common_utils import extract_expert_number_from_param

        mapping = task.mapping
        ep_rank, ep_size = int(mapping.ep_rank), int(mapping.ep_size)
        experts = int(config.num_moe_experts)
        try:
            g = int(extract_expert_number_from_param(task.global_param_name))
        except ValueError as exc:
            raise _Residual(f"no expert index in {task.global_param_name}") from exc
        per_rank = experts // ep_size if ep_size else 0
        try:
            wrapped = PerExpert(inner, ep_rank, ep_size, experts, g - ep_rank * per_rank)
        except LayoutError as exc:
            raise _Residual(str(exc)) from exc
        if wrapped.expert != g:
            raise _Residual(
                f"expert {g} is not local expert {wrapped.local_index} of EP rank {ep_rank}"
            )
        return wrapped, ep_rank


class _Residual(DcrError):
    """A mapping dcr cannot prove element-wise: the tensor goes through residual conversion."""


def _kind(m: AffineMapping) -> str:
    """``"Tied(ColumnParallel)"``, ``"PerExpert(GatedMLP)"``, ``"RowParallel"``, ..."""
    if isinstance(m, Tied | PerExpert):
        return f"{type(m).__name__}({_kind(m.inner)})"
    return type(m).__name__


def _canonical(m: AffineMapping, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
    """The canonical tensors an untied, unwrapped mapping writes, with their shapes."""
    if isinstance(m, Direct):
        return (TensorSpec(name=m.name, shape=m.shape, dtype=dtype),)
    if isinstance(m, ColumnParallel | RowParallel):
        return (TensorSpec(name=m.name, shape=tuple(m.canonical_shape), dtype=dtype),)
    if isinstance(m, GatedMLP):
        shape = tuple(m.canonical_shape)
        return (
            TensorSpec(name=m.gate_name, shape=shape, dtype=dtype),
            TensorSpec(name=m.up_name, shape=shape, dtype=dtype),
        )
    if isinstance(m, FusedQKV):
        q = (m.num_heads * m.head_dim, *m.inner)
        kv = (m.num_kv_heads * m.head_dim, *m.inner)
        return (
            TensorSpec(name=m.q_name, shape=q, dtype=dtype),
            TensorSpec(name=m.k_name, shape=kv, dtype=dtype),
            TensorSpec(name=m.v_name, shape=kv, dtype=dtype),
        )
    raise _Residual(f"no canonical shapes for {type(m).__name__}")


def _exports_tied(hf: Any, name: str) -> bool:
    """Whether the Bridge's export emits the tied output name (as ``export_hf_weights``)."""
    from transformers import PretrainedConfig

    if isinstance(hf, PretrainedConfig):
        return True
    state = getattr(hf, "state", None)
    source = getattr(state, "source", None)
    return source is not None and name in source.get_all_keys()


def _size(getter: str) -> int:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(getattr(parallel_state, getter)())
