"""LocalRefit through the real protocol engines: every fault of the plan recovers bit-exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dcr import LocalRefit, StateDictSource, TorchModuleLoader, TrainLayout
from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.faulty import Faults
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.delta.build import BuildConfig
from dcr.engine.receiver import ReceiverHooks
from dcr.local import LOCAL_TIMEOUTS, RefitConfig, TransitionFailed
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb, special_patterns
from dcr.protocol.receiver import QueueConfig
from dcr.protocol.types import Mode, TransitionOutcome
from dcr.tensors.bits import bits

SMALL = BuildConfig(chunk_bytes=4096, bucket_bytes=8192)  # several payloads per owner


def setup(family="qwen3_moe", layout=None, serving=(1, 2), config=None, seed=0, **kwargs):
    cfg = tiny_config(family)
    w0 = random_state_dict(cfg, family, seed=seed)
    ranks = [
        ShardedServingLoader.dense(cfg, family, w0, tp_size=tp, tp_rank=r)
        for tp in serving
        for r in range(tp)
    ]
    layout = layout or TrainLayout(tp=2, ep=2 if family == "qwen3_moe" else 1, dp=2)
    source = StateDictSource(w0, layout=layout, family=family, config=cfg)
    refit = LocalRefit(source, ranks, config=config or RefitConfig(build=SMALL), **kwargs)
    return cfg, family, w0, ranks, refit


def assert_exact(cfg, family, w, ranks, serving=(1, 2)):
    fresh = [
        ShardedServingLoader.dense(cfg, family, w, tp_size=tp, tp_rank=r)
        for tp in serving
        for r in range(tp)
    ]
    for i, (a, b) in enumerate(zip(ranks, fresh, strict=True)):
        assert module_bit_mismatches(a.module, b.module) == [], f"rank {i}"


def assert_baseline_is(refit, w):
    """Owners' trackers hold exactly the committed version's shards (B^v = W^v)."""
    shards = refit.source.candidate_shards(w)
    for owner in refit.group.owners.values():
        for key, tracker in owner.trackers.items():
            assert np.array_equal(bits(tracker), bits(shards[key])), key


FAULTS = {
    "clean": (Faults(), ["mixed"]),
    "kill-receiver": (Faults(kill_receiver="r1", kill_receiver_after=2), ["mixed", "overwrite"]),
    "kill-owner": (Faults(kill_owner="o1", kill_owner_after=1), ["mixed", "overwrite"]),
    "drop": (Faults(drop=1), ["mixed", "overwrite"]),
    "corrupt": (Faults(corrupt=1), ["mixed", "overwrite"]),
    "conflicting-duplicate": (Faults(conflicting=1), ["mixed", "overwrite"]),
    "duplicate-reorder": (Faults(duplicate=3, reorder=True), ["mixed"]),
    "lost-commit-reply": (Faults(lose_commit_reply=True), ["mixed"]),
    "late-commit": (Faults(late_commit=True), ["mixed", "overwrite"]),
    "failover": (Faults(failover=True, failover_after=2), ["mixed", "overwrite"]),
    "failover-old-keeps-running": (
        Faults(failover=True, old_keeps_running=True, failover_after=2),
        ["mixed", "overwrite"],
    ),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_recovers_bit_exactly(name):
    faults, modes = FAULTS[name]
    cfg, family, w, ranks, refit = setup()
    with refit:
        for v in range(1, 3):  # the fault strikes the first refit; the next must be clean
            new = perturb(w, rate=0.03, seed=v)
            if v == 1:
                special_patterns(new, seed=v)
            report = refit.refit(new, faults=faults if v == 1 else None)
            assert report.version == v
            assert_exact(cfg, family, new, ranks)
            assert_baseline_is(refit, new)
            if v == 1:
                assert [a.mode.value for a in report.attempts] == modes
                log = report.faults
                if faults.drop:
                    assert log.dropped == 1
                if faults.kill_receiver or faults.kill_owner:
                    victim = faults.kill_receiver or faults.kill_owner
                    assert log.killed == log.restarted == (victim,)
                if faults.old_keeps_running:
                    # The replaced coordinator stands down, or its commit landed first.
                    assert log.replaced_outcome in ("conflict", "committed")
                    assert report.committed_by is not None
                if faults.reorder:
                    assert log.reordered > 0
            else:
                assert [a.mode for a in report.attempts] == [Mode.MIXED]
            w = new
        assert refit.cluster.members(refit._committed) == ("r0", "r1", "r2")


def test_killed_receiver_rejoins_by_dense_refit_and_holds_every_later_version():
    cfg, family, w, ranks, refit = setup(family="qwen3")
    with refit:
        new = perturb(w, rate=0.05, seed=1)
        report = refit.refit(new, faults=Faults(kill_receiver="r2", kill_receiver_after=1))
        assert report.faults.killed == ("r2",)
        # the survivors were repaired by the overwrite retry; r2 restored by dense refit
        assert_exact(cfg, family, new, ranks)
        survivors = set(report.attempts[-1].receivers)
        assert {"r0", "r1"} <= survivors
        newer = perturb(new, rate=0.05, seed=2)
        report = refit.refit(newer)
        assert report.attempts[0].receivers == ("r0", "r1", "r2")  # r2 is required again
        assert_exact(cfg, family, newer, ranks)


def test_sqlite_store_and_asynchronous_mode(tmp_path):
    store = SqliteCommitStore(tmp_path / "commit.db")
    cfg, family, w, ranks, refit = setup(
        family="llama",
        layout=TrainLayout(tp=2, dp=2),
        # a lost payload is noticed by the arrival deadline in asynchronous RL
        config=RefitConfig(build=SMALL, sync=False, timeouts=replace(LOCAL_TIMEOUTS, arrival_s=3)),
        store=store,
    )
    with refit:
        for v in range(1, 3):
            w = perturb(w, rate=0.03, seed=v)
            refit.refit(w, faults=Faults(drop=1) if v == 1 else None)
            assert_exact(cfg, family, w, ranks)
    import anyio

    state = anyio.run(SqliteCommitStore(tmp_path / "commit.db").read)
    assert state.record.version == 2 and len(state.obsolete) == 1


def test_bounded_queue_back_pressure():
    cfg, family, w, ranks, refit = setup(
        family="llama",
        layout=TrainLayout(tp=2, dp=2),
        config=RefitConfig(build=SMALL, queue=QueueConfig(groups=1, group_size=1)),
    )
    with refit:
        new = perturb(w, rate=0.3, seed=3)
        report = refit.refit(new, faults=Faults(reorder=True))
        assert report.num_payloads > 8
        assert_exact(cfg, family, new, ranks)


def test_gate_and_kv_cache_hooks_run_in_order():
    log: list[str] = []

    def hooks(name):
        async def close():
            log.append(f"{name}:close")

        async def invalidate():
            log.append(f"{name}:kv")

        async def reopen():
            log.append(f"{name}:open")

        return ReceiverHooks(close_gate=close, invalidate_kv_cache=invalidate, open_gate=reopen)

    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=4)
    module = ShardedServingLoader.dense(cfg, "llama", w)
    source = StateDictSource(w, layout=TrainLayout(tp=2), family="llama", config=cfg)
    with LocalRefit(source, [module], hooks={"r0": hooks("r0")}) as refit:
        new = perturb(w, rate=0.03, seed=5)
        refit.refit(new)
        import time

        deadline = time.monotonic() + 5
        while "r0:open" not in log and time.monotonic() < deadline:
            time.sleep(0.01)
    assert log == ["r0:close", "r0:kv", "r0:open"]


def test_rejected_prepare_ends_the_transition_and_changes_nothing():
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=6)
    module = ShardedServingLoader.dense(cfg, "llama", w)
    before = {n: t.clone() for n, t in module.module.state_dict().items()}
    source = StateDictSource(w, layout=TrainLayout(tp=2), family="llama", config=cfg)
    with LocalRefit(source, [module]) as refit:
        # the receiver's loader classification no longer allows what mixed mode would XOR
        receiver = refit.receivers[0]
        receiver._xor_allowed = frozenset()
        with pytest.raises(TransitionFailed) as err:
            refit.refit(perturb(w, rate=0.05, seed=7))
        assert err.value.outcome is TransitionOutcome.REJECTED
    after = module.module.state_dict()
    assert all(np.array_equal(bits(before[n]), bits(after[n])) for n in before)


def test_plain_modules_and_overwrite_mode():
    sd = {"a": torch.randn(300, 7).to(torch.bfloat16), "b": torch.randn(41)}
    from dcr.models.modules import module_from_state_dict

    mods = [module_from_state_dict(sd) for _ in range(2)]
    with LocalRefit(
        StateDictSource(sd, layout=TrainLayout(dp=3)),
        [TorchModuleLoader(m) for m in mods],
        mode="overwrite",
        config=RefitConfig(build=BuildConfig(chunk_bytes=512, bucket_bytes=512)),
    ) as refit:
        new = perturb(sd, rate=0.2, seed=8)
        report = refit.refit(new, faults=Faults(kill_receiver="r0", kill_receiver_after=1))
        assert report.xor_items == 0 and report.mode is Mode.OVERWRITE
    for m in mods:
        assert module_bit_mismatches(m, module_from_state_dict(new)) == []


def test_asynchronous_refits_decode_each_payload_once(monkeypatch):
    """In asynchronous RL a staged payload keeps the decode of its reception check: every
    receiver decodes every payload once, none of them again under the closed gate."""
    import dcr.engine.receiver as engine_receiver

    decoded: list[int] = []
    real = engine_receiver.decode_payload

    def counting(data, **kwargs):
        decoded.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(engine_receiver, "decode_payload", counting)
    cfg, family, w, ranks, refit = setup(
        family="llama", layout=TrainLayout(tp=2, dp=2), config=RefitConfig(build=SMALL, sync=False)
    )
    with refit:
        new = perturb(w, rate=0.03, seed=5)
        report = refit.refit(new)
        assert_exact(cfg, family, new, ranks)
    assert report.num_payloads > 1
    assert len(decoded) == report.num_payloads * len(ranks)
