"""A hypothesis state machine over the whole system with real tensors.

:class:`RefitMachine` runs :class:`~dcr.LocalRefit` -- the real protocol cores on the anyio
engine with the in-memory transport, control channel and commit store -- on a tiny MoE model
refit into two serving layouts, and applies one rule per step: a clean refit, or a refit whose
first attempt suffers a fault (payloads dropped, duplicated, reordered, corrupted or re-sent
with conflicting bytes; a receiver or owner crash; a commit that reaches the store after its
deadline; a lost commit reply; a rival coordinator taking over while the old one dies or keeps
running).  After every step it checks, on bits:

- every receiver rank equals a dense load of the committed version (G1, no mixture);
- every owner's trackers equal the committed version's shards (the baseline the next delta
  uses is the committed version);
- the commit record names the committed version, once per successful refit (no lost or
  doubled commit), and every receiver's protocol core holds that record.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dcr.adapters.faulty import Faults
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.sources import StateDictSource
from dcr.delta.build import BuildConfig
from dcr.delta.layout import TrainLayout
from dcr.local import LocalRefit, RefitConfig
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb, special_patterns
from dcr.protocol.types import Mode
from dcr.tensors.bits import bits

__all__ = ["FAULT_RULES", "RefitMachine"]

SERVING = (1, 2)

FAULT_RULES: dict[str, Faults] = {
    "drop": Faults(drop=1),
    "duplicate": Faults(duplicate=2),
    "reorder": Faults(reorder=True),
    "corrupt": Faults(corrupt=1),
    "conflicting": Faults(conflicting=1),
    "crash-receiver": Faults(kill_receiver="r1", kill_receiver_after=1),
    "crash-receiver-late": Faults(kill_receiver="r2", kill_receiver_after=3),
    "crash-owner": Faults(kill_owner="o2", kill_owner_after=1),
    "expire": Faults(late_commit=True),
    "lost-reply": Faults(lose_commit_reply=True),
    "failover": Faults(failover=True, failover_after=1),
    "rival-commit": Faults(failover=True, old_keeps_running=True, failover_after=2),
    "everything-at-once": Faults(drop=1, duplicate=1, reorder=True, corrupt=1),
}


class RefitMachine(RuleBasedStateMachine):
    """One LocalRefit, many transitions, faults on the way; bit-exact after every commit."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = tiny_config("qwen3_moe")
        self.state = random_state_dict(self.cfg, "qwen3_moe", seed=0)
        self.ranks = self._dense_ranks()
        source = StateDictSource(
            self.state,
            layout=TrainLayout(tp=2, ep=2, dp=2),
            family="qwen3_moe",
            config=self.cfg,
        )
        self.refit = LocalRefit(
            source,
            self.ranks,
            config=RefitConfig(build=BuildConfig(chunk_bytes=4096, bucket_bytes=8192)),
        )
        self.commits = 0
        self.steps = 0
        self.seen: dict[str, int] = {}

    def teardown(self) -> None:
        self.refit.close()

    def _dense_ranks(self) -> list[ShardedServingLoader]:
        """Every serving rank freshly loaded from the committed version."""
        return [
            ShardedServingLoader.dense(self.cfg, "qwen3_moe", self.state, tp_size=tp, tp_rank=r)
            for tp in SERVING
            for r in range(tp)
        ]

    def _step(self, rate: float, seed: int, special: bool, faults: Faults, mode: Mode) -> None:
        new = perturb(self.state, rate=rate, seed=seed)
        if special:
            special_patterns(new, seed=seed)
        report = self.refit.refit(new, faults=faults, mode=mode)
        self.commits += 1
        self.steps += 1
        assert report.version == self.commits
        assert report.attempts and report.attempts[0].mode is mode
        assert all(a.mode is Mode.OVERWRITE for a in report.attempts[1:])
        if mode is Mode.OVERWRITE:
            assert report.xor_entries == report.ulp_entries == 0 and report.mode is Mode.OVERWRITE
        self.state = new

    @rule(
        rate=st.sampled_from([0.0, 0.01, 0.05, 0.5]),
        seed=st.integers(1, 10_000),
        special=st.booleans(),
        mode=st.sampled_from([Mode.MIXED, Mode.OVERWRITE]),
    )
    def clean_refit(self, rate: float, seed: int, special: bool, mode: Mode) -> None:
        self._step(rate, seed, special, Faults(), mode)
        self.seen["clean"] = self.seen.get("clean", 0) + 1

    @rule(
        fault=st.sampled_from(sorted(FAULT_RULES)),
        rate=st.sampled_from([0.01, 0.05]),
        seed=st.integers(1, 10_000),
        special=st.booleans(),
    )
    def faulty_refit(self, fault: str, rate: float, seed: int, special: bool) -> None:
        self._step(rate, seed, special, FAULT_RULES[fault], Mode.MIXED)
        self.seen[fault] = self.seen.get(fault, 0) + 1

    @invariant()
    def receivers_hold_exactly_the_committed_version(self) -> None:
        for i, (a, b) in enumerate(zip(self.ranks, self._dense_ranks(), strict=True)):
            assert module_bit_mismatches(a.module, b.module) == [], f"rank {i}"

    @invariant()
    def baseline_is_the_committed_version(self) -> None:
        shards = self.refit.source.candidate_shards(self.state)
        for owner in self.refit.group.owners.values():
            for key, tracker in owner.trackers.items():
                assert np.array_equal(bits(tracker), bits(shards[key])), key

    @invariant()
    def one_commit_per_refit(self) -> None:
        record = self.refit.record
        assert record.version == self.commits
        for name, svc in self.refit.cluster.receiver_services.items():
            assert svc.core.held == record, name
            assert not svc.core.dirty, name
