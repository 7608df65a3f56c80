"""What every fleet process derives from the fleet file's ``[model]`` section.

The demo fleet trains a synthetic checkpoint (:class:`~dcr.testing.synthetic.SyntheticRun`)
and serves it from vLLM-like sharded reference ranks
(:class:`~dcr.testing.reference.ShardedReferenceModel`).  Each process computes only its
part: a trainer rank its shards, a receiver nothing but its digests, the launcher the
canonical tensors it checks receivers against.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from dcr.apply.receiver import Receiver, xor_allowed_across
from dcr.delta.bits import bits
from dcr.delta.layout import TrainingPlan, TrainLayout, build_plan
from dcr.delta.owner import BuildConfig
from dcr.delta.records import TensorSpec
from dcr.engine.setup import Integration
from dcr.fleet.config import FleetConfig, ReceiverSpec
from dcr.testing.models import canonical_shapes, tiny_config
from dcr.testing.reference import ShardedReferenceLoader, ShardedReferenceModel
from dcr.testing.synthetic import SyntheticRun

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
        return sized_config(m.family, m.size_mb * MB, **m.overrides)

    @property
    def family(self) -> str:
        return self.fleet.model.family

    @cached_property
    def run(self) -> SyntheticRun:
        m = self.fleet.model
        return SyntheticRun(
            config=self.config, family=m.family, seed=m.seed, rate=m.rate, rates=m.rates
        )

    @cached_property
    def catalog(self) -> dict[str, TensorSpec]:
        return {
            n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
            for n, s in canonical_shapes(self.config, self.family).items()
        }

    @cached_property
    def plan(self) -> TrainingPlan:
        t = self.fleet.trainer
        layout = TrainLayout(tp=t.tp, ep=t.ep, dp=t.dp)
        return build_plan(self.catalog, layout, family=self.family, config=self.config)

    @property
    def build(self) -> BuildConfig:
        t = self.fleet.trainer
        return BuildConfig(chunk_bytes=int(t.chunk_mb * (1 << 20)),
                           bucket_bytes=int(t.bucket_mb * (1 << 20)))  # fmt: skip

    @property
    def checkpoint_bytes(self) -> int:
        return sum(s.nbytes for s in self.catalog.values())

    def receiver_model(self, spec: ReceiverSpec) -> ShardedReferenceModel:
        """An empty serving rank (all zeros): it restores the committed version by dense
        refit over the fleet."""
        return ShardedReferenceModel(self.config, self.family, tp_size=spec.tp, tp_rank=spec.rank)

    @cached_property
    def xor_names(self) -> frozenset[str]:
        """Names every receiver's loader path preserves bit for bit (mixed mode XORs them).

        Classification depends on the module structure, not on sizes, so it is computed on
        a narrow copy of the model with the same layers and tensor names.
        """
        narrow = dict(self.config)
        heads = int(narrow["num_attention_heads"])
        kv = int(narrow.get("num_key_value_heads", heads))
        narrow.update(hidden_size=16 * heads // kv * kv, intermediate_size=32, head_dim=8,
                      vocab_size=64)  # fmt: skip
        if narrow.get("num_experts"):
            narrow["moe_intermediate_size"] = 16
        catalog = {
            n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
            for n, s in canonical_shapes(narrow, self.family).items()
        }
        receivers = []
        for spec in {(r.tp, r.rank) for r in self.fleet.receivers}:
            model = ShardedReferenceModel(narrow, self.family, tp_size=spec[0], tp_rank=spec[1])
            receiver = Receiver(ShardedReferenceLoader(model), catalog)
            receiver.prewarm()
            receivers.append(receiver)
        return xor_allowed_across(receivers)

    def integration(self) -> Integration:
        return Integration(
            catalog=self.catalog,
            xor_names=self.xor_names,
            owner_ids={f"o{rank}": rank for rank in range(self.plan.layout.world_size)},
        )

    def expected_digests(
        self, state: Mapping[str, torch.Tensor], specs: Iterable[ReceiverSpec]
    ) -> dict[tuple[int, int], dict[str, str]]:
        """Digests of a dense load of ``state`` into each serving rank layout."""
        out = {}
        for tp, rank in sorted({(s.tp, s.rank) for s in specs}):
            loader = ShardedReferenceLoader.dense(
                self.config, self.family, state, tp_size=tp, tp_rank=rank
            )
            out[(tp, rank)] = digests(loader.module)
        return out
