"""What every fleet process derives from the fleet file's ``[model]`` section.

The demo fleet trains a synthetic checkpoint (:class:`~dcr.models.synthetic.SyntheticRun`)
and serves it from vLLM-like sharded serving ranks
(:class:`~dcr.adapters.loaders.sharded.ShardedServingModel`).  Each process computes only its
part: a trainer rank its shards, a receiver nothing but its digests, the launcher the
canonical tensors it checks receivers against.

With ``[model] checkpoint`` the catalog is the checkpoint's (read from its safetensors
headers, :mod:`dcr.catalog`) and the config its ``config.json``: receivers hosted by an engine
serving that checkpoint need nothing more.  The synthetic trainer and the sharded ranks
model it when it is a checkpoint of one of their families in one dtype (synthetic weights,
the checkpoint's names, shapes and dtype).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
from dcr.apply.applier import Applier, xor_allowed_across
from dcr.catalog import read_catalog, read_config
from dcr.delta.build import BuildConfig
from dcr.delta.layout import TrainingPlan, TrainLayout, build_plan
from dcr.engine.integration import Integration
from dcr.errors import CheckpointError, ConfigError
from dcr.fleet.config import FleetConfig
from dcr.fleet.sections import ReceiverSpec
from dcr.models.families import FAMILIES, canonical_shapes, tiny_config
from dcr.models.fp8 import rollout_state_dict
from dcr.models.synthetic import SyntheticRun
from dcr.tensors.bits import bits, dtype_name
from dcr.tensors.fp8 import rollout_catalog
from dcr.tensors.records import TensorSpec

__all__ = ["FleetModel", "digests", "sized_config"]

MB = 1_000_000


def sized_config(family: str, size_bytes: float, **overrides: Any) -> dict[str, Any]:
    """A config of ``family`` of roughly ``size_bytes`` in bf16 (layers added until it fits);
    ``size_bytes <= 0`` gives the tiny test config with ``overrides``."""
    if size_bytes <= 0:
        return tiny_config(family, **overrides)
    dims = {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
    }
    layers = 2
    while True:
        cfg = tiny_config(family, **{**dims, "num_hidden_layers": layers, **overrides})
        total = sum(2 * int(np.prod(s)) for s in canonical_shapes(cfg, family).values())
        if total >= size_bytes or layers >= 128:
            return cfg
        layers += 1


def digests(module: torch.nn.Module) -> dict[str, str]:
    """BLAKE2b-64 of the stored bits of every parameter and buffer (a bit-for-bit summary)."""
    out = {}
    pairs = [*module.named_parameters(remove_duplicate=False),
             *module.named_buffers(remove_duplicate=False)]  # fmt: skip
    for name, t in pairs:
        data = bits(t.detach().contiguous()).tobytes()
        h = hashlib.blake2b(data, digest_size=8)
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        out[name] = h.hexdigest()
    return out


@dataclass(frozen=True)
class FleetModel:
    """The model, training plan and integration setup of a fleet."""

    fleet: FleetConfig

    @cached_property
    def config(self) -> dict[str, Any]:
        m = self.fleet.model
        if m.checkpoint is not None:
            return read_config(m.checkpoint)
        return sized_config(m.family, m.size_mb * MB, **m.overrides)

    @cached_property
    def family(self) -> str:
        """The model family: ``[model] family``, or the checkpoint's ``model_type``."""
        if self.fleet.model.checkpoint is not None:
            return str(self.config.get("model_type", ""))
        return self.fleet.model.family

    @cached_property
    def run(self) -> SyntheticRun:
        self.require_synthetic()
        m = self.fleet.model
        return SyntheticRun(
            config=self.config, family=self.family, seed=m.seed, rate=m.rate, rates=m.rates,
            dtype=self.dtype,
        )  # fmt: skip

    @cached_property
    def catalog(self) -> dict[str, TensorSpec]:
        if self.fleet.model.checkpoint is not None:
            return read_catalog(self.fleet.model.checkpoint)
        return {
            n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
            for n, s in canonical_shapes(self.config, self.family).items()
        }

    @cached_property
    def dtype(self) -> torch.dtype:
        """The dtype of the synthetic weights and sharded ranks: the catalog's one dtype
        (bfloat16 when the catalog mixes dtypes, which :meth:`require_synthetic` refuses)."""
        dtypes = {s.dtype for s in self.catalog.values()}
        return dtypes.pop() if len(dtypes) == 1 else torch.bfloat16

    @cached_property
    def synthetic_problem(self) -> str | None:
        """Why the synthetic trainer and the sharded ranks cannot model this catalog
        (``None``: they can -- always without ``[model] checkpoint``)."""
        checkpoint = self.fleet.model.checkpoint
        if checkpoint is None:
            return None
        try:
            family = self.family
        except CheckpointError as exc:
            return exc.message
        if family not in FAMILIES:
            return f"its model_type is {self.family!r}, not one of {list(FAMILIES)}"
        dtypes = sorted({dtype_name(s.dtype) for s in self.catalog.values()})
        if len(dtypes) != 1:
            return f"it mixes dtypes {dtypes}"
        try:
            shapes = canonical_shapes(self.config, self.family)
        except (KeyError, TypeError, ValueError) as exc:
            return f"its config.json lacks what a {self.family} layout needs ({exc!r})"
        found = {n: s.shape for n, s in self.catalog.items()}
        if found != shapes:
            odd = sorted(n for n in set(found) | set(shapes) if found.get(n) != shapes.get(n))
            return f"its tensors are not the {self.family} layout ({odd[:3]} differ)"
        return None

    def require_synthetic(self) -> None:
        """Raise :class:`~dcr.errors.ConfigError` when the synthetic trainer and the reference
        ranks cannot model this catalog (see :attr:`synthetic_problem`)."""
        problem = self.synthetic_problem
        if problem is not None:
            raise ConfigError(
                f"dcr's synthetic trainer and sharded receivers cannot model the checkpoint "
                f"{self.fleet.model.checkpoint}: {problem}; receivers hosted by an engine "
                "serving it, with your own trainer's owners, can",
                check="checkpoint",
            )

    @cached_property
    def plan(self) -> TrainingPlan:
        tp, ep, dp = self.fleet.trainer.layout
        layout = TrainLayout(tp=tp, ep=ep, dp=dp)
        family = self.family if self.family in FAMILIES else None
        return build_plan(self.catalog, layout, family=family, config=self.config,
                          fp8=self.fleet.model.fp8)  # fmt: skip

    @cached_property
    def wire_catalog(self) -> dict[str, TensorSpec]:
        """What receivers hold: the catalog, or with ``[model] rollout_dtype = "fp8"`` its FP8
        quantization (float8 projection weights followed by their scales)."""
        scheme = self.fleet.model.fp8
        return self.catalog if scheme is None else rollout_catalog(self.catalog, scheme)

    def rollout(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors receivers hold of a version whose canonical tensors are ``state``."""
        scheme = self.fleet.model.fp8
        return dict(state) if scheme is None else rollout_state_dict(state, scheme)

    @property
    def build(self) -> BuildConfig:
        return self.fleet.trainer.build_config()

    @property
    def checkpoint_bytes(self) -> int:
        return sum(s.nbytes for s in self.catalog.values())

    def receiver_model(self, spec: ReceiverSpec) -> ShardedServingModel:
        """An empty serving rank (all zeros): it restores the committed version by dense
        refit over the fleet."""
        self.require_synthetic()
        return ShardedServingModel(
            self.config, self.family, tp_size=spec.tp, tp_rank=spec.rank, dtype=self.dtype,
            fp8=self.fleet.model.fp8,
        )  # fmt: skip

    @cached_property
    def xor_names(self) -> frozenset[str]:
        """Names the sharded ranks' loader paths preserve bit for bit: the fallback of a
        synthetic fleet's integration setup, for a prepare that binds no refused set.

        A fleet's prepares bind what travels relative from the receivers' own reports (the
        ``xor_refused`` of their status, their loader classification at prewarm), so owners
        need not know the serving side; this prediction only stands in for a prepare that
        binds none.  Classification depends on the module structure, not on sizes, so it is
        computed on a narrow copy of the model with the same layers and tensor names.  A
        checkpoint the sharded ranks cannot model XORs nothing: every record is an
        overwrite.
        """
        if self.synthetic_problem is not None:
            return frozenset()
        narrow = dict(self.config)
        heads = int(narrow["num_attention_heads"])
        kv = int(narrow.get("num_key_value_heads", heads))
        narrow.update(hidden_size=16 * heads // kv * kv, intermediate_size=32, head_dim=8,
                      vocab_size=64)  # fmt: skip
        if narrow.get("num_experts"):
            narrow["moe_intermediate_size"] = 16
        catalog = {
            n: TensorSpec(name=n, shape=s, dtype=self.dtype)
            for n, s in canonical_shapes(narrow, self.family).items()
        }
        receivers = []
        for spec in {(r.tp, r.rank) for r in self.fleet.receivers}:
            model = ShardedServingModel(
                narrow, self.family, tp_size=spec[0], tp_rank=spec[1], dtype=self.dtype
            )
            receiver = Applier(ShardedServingLoader(model), catalog)
            receiver.prewarm()
            receivers.append(receiver)
        return xor_allowed_across(receivers)

    def integration(self) -> Integration:
        return Integration(
            catalog=self.wire_catalog,
            xor_names=self.xor_names,
            owner_ids={f"o{rank}": rank for rank in range(self.plan.layout.world_size)},
        )

    def expected_digests(
        self, state: Mapping[str, torch.Tensor], specs: Iterable[ReceiverSpec]
    ) -> dict[tuple[int, int], dict[str, str]]:
        """Digests of a dense load of ``state`` (canonical tensors; the rollout's conversion of
        them, :meth:`rollout`) into each serving rank layout."""
        self.require_synthetic()
        out = {}
        served = self.rollout(state)
        for tp, rank in sorted({(s.tp, s.rank) for s in specs}):
            loader = ShardedServingLoader.dense(
                self.config, self.family, served, tp_size=tp, tp_rank=rank, dtype=self.dtype,
                fp8=self.fleet.model.fp8,
            )  # fmt: skip
            out[(tp, rank)] = digests(loader.module)
        return out
