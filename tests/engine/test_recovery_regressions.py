"""Recoveries that take one attempt's work, not a deadline, and outcomes that say what
happened (problems found when the engine was tried as a new user would)."""

from __future__ import annotations

import random
from dataclasses import replace

import anyio
import pytest

from dcr import LocalRefit, StateDictSource, TrainLayout
from dcr.adapters.commit.base import CommitState, Transaction
from dcr.adapters.commit.memory import MemoryCommitStore
from dcr.adapters.faulty import Faults
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.delta.build import BuildConfig
from dcr.local import LOCAL_TIMEOUTS, RefitConfig
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol import commands as cmd

SMALL = BuildConfig(chunk_bytes=4096, bucket_bytes=8192)
SLOW = replace(LOCAL_TIMEOUTS, prepare_s=300.0, arrival_s=300.0, gate_s=300.0, flush_s=300.0)
"""Deadlines far beyond the test's own time limit: a recovery that waited for one would
time the test out, so passing shows the recovery took an attempt's work."""


def fleet(family: str = "llama", **config: object):  # type: ignore[no-untyped-def]
    cfg = tiny_config(family)
    w = random_state_dict(cfg, family, seed=11)
    ranks = [ShardedServingLoader.dense(cfg, family, w, tp_size=2, tp_rank=r) for r in (0, 1)]
    source = StateDictSource(w, layout=TrainLayout(tp=2, dp=2), family=family, config=cfg)
    settings = {"build": SMALL, "timeouts": SLOW, **config}
    return cfg, w, ranks, source, RefitConfig(**settings)  # type: ignore[arg-type]


def exact(cfg, w, ranks) -> bool:  # type: ignore[no-untyped-def]
    fresh = [ShardedServingLoader.dense(cfg, "llama", w, tp_size=2, tp_rank=r) for r in (0, 1)]
    return all(
        module_bit_mismatches(a.module, b.module) == [] for a, b in zip(ranks, fresh, strict=True)
    )


def failure_reasons(refit: LocalRefit) -> list[str]:
    return [
        c.reason
        for co in refit.cluster._coordinators
        for c in co.commands
        if isinstance(c, cmd.TransitionEnded)
    ]


def test_a_killed_owner_is_prepared_again_at_once_never_after_the_prepare_deadline() -> None:
    """The retry's prepare reaches a restarted owner even when it is sent before the new
    process opened its inbox (calls wait for it), so the deadline never decides."""
    cfg, w, ranks, source, config = fleet()
    with LocalRefit(source, ranks, config=config) as refit:
        for v in range(1, 9):
            w = perturb(w, rate=0.03, seed=v)
            victim = f"o{v % 4}"
            report = refit.refit(w, faults=Faults(kill_owner=victim, kill_owner_after=v % 3))
            assert report.faults.killed == (victim,) and exact(cfg, w, ranks)
            assert len(report.attempts) <= 3
            assert not any("deadline" in r for r in failure_reasons(refit)), v


def test_asynchronous_mode_recovers_from_a_lost_payload_without_the_arrival_deadline() -> None:
    cfg, w, ranks, source, config = fleet(sync=False)
    with LocalRefit(source, ranks, config=config) as refit:
        w = perturb(w, rate=0.03, seed=1)
        report = refit.refit(w, faults=Faults(drop=1))
        assert [a.mode.value for a in report.attempts] == ["mixed", "overwrite"]
        assert exact(cfg, w, ranks)
        # The receivers' arrival check named the lost payload; no deadline expired.
        reasons = " ".join(failure_reasons(refit))
        assert "deadline" not in reasons


class SlowStore(MemoryCommitStore):
    """A commit store whose transactions take 0-30 ms, like a remote one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    async def _transact(self, fn: Transaction) -> CommitState:
        await anyio.sleep(self._rng.uniform(0.0, 0.03))
        return await super()._transact(fn)


def test_a_commit_by_the_replaced_coordinator_is_reported_as_a_commit() -> None:
    """With the replaced coordinator still running, either one may commit first; the caller
    always gets the committed version and who committed it, never a failure."""
    cfg, w, ranks, source, config = fleet(timeouts=LOCAL_TIMEOUTS)
    by: list[int | None] = []
    with LocalRefit(source, ranks, config=config, store=SlowStore(seed=5)) as refit:
        for v in range(1, 9):
            w = perturb(w, rate=0.03, seed=v)
            report = refit.refit(
                w, faults=Faults(failover=True, old_keeps_running=True, failover_after=v % 3)
            )
            assert report.version == v and refit.record.version == v
            assert report.committed_by is not None
            by.append(report.committed_by)
            assert exact(cfg, w, ranks)
    assert len(by) == 8


def test_local_refit_takes_adapters_by_registered_name_zmq_control_included() -> None:
    """``control="zmq"``: every call and reply crosses real sockets through the codec."""
    cfg, w, ranks, source, config = fleet(timeouts=LOCAL_TIMEOUTS)
    with LocalRefit(source, ranks, config=config, control="zmq", transport="memory") as refit:
        assert type(refit.cluster.control).__name__ == "ZmqControl"
        for v in (1, 2):
            w = perturb(w, rate=0.03, seed=v)
            refit.refit(
                w, faults=Faults(kill_receiver="r1", kill_receiver_after=1) if v == 2 else None
            )
            assert exact(cfg, w, ranks)


@pytest.mark.timeout(30, method="thread")  # a regression hangs: end it, with stacks
def test_a_send_that_never_returns_is_cancelled_when_its_attempt_stops() -> None:
    """A send to a peer that died holding the payload never returns.  The attempt fails by
    its flush deadline, and the stop that follows cancels the send: an owner that waited for
    it would never acknowledge the stop, and the fleet would wait forever."""
    cfg, w, ranks, source, config = fleet(timeouts=replace(SLOW, flush_s=2.0))
    with LocalRefit(source, ranks, config=config) as refit:
        w = perturb(w, rate=0.03, seed=1)
        report = refit.refit(w, faults=Faults(stall=1))
        assert report.faults.stalled == 1
        assert [a.mode.value for a in report.attempts] == ["mixed", "overwrite"]
        assert "flush deadline expired" in " ".join(failure_reasons(refit))
        assert exact(cfg, w, ranks)
