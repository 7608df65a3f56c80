"""The real cores through the in-memory world: every failure path of App. B.2, by hand.

Each test drives :class:`~dcr.testing.protocol_world.World` into one situation of the paper and
checks the outcome, the storage of every receiver (abstract versions) and the model's
invariants after every delivery.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import AttemptPhase, ReceiverPhase, TransitionPhase
from dcr.protocol.types import CommitRecord, Mode, Stage, TransitionOutcome
from dcr.testing.protocol_world import World
from dcr.testing.spec.invariants import violations
from dcr.testing.spec.state import LOST, V0, V1
from dcr.testing.world_messages import Kind, Message


def checked(world: World) -> World:
    """Check the shared invariants after every delivery the test makes."""
    deliver = world.deliver

    def deliver_and_check(index: int) -> Message:
        m = deliver(index)
        found = violations(world.project())
        assert not found and not world.problems, (found, world.problems)
        return m

    world.deliver = deliver_and_check  # type: ignore[method-assign]
    return world


def make(**kw: object) -> World:
    w = checked(World(**kw))  # type: ignore[arg-type]
    w.start()
    return w


def expire(w: World, stage: Stage, tau: int | None = None) -> None:
    [i] = [i for i, (_, t, s) in enumerate(w.timers) if s is stage and tau in (None, t)][-1:]
    w.expire(i)


def storage(w: World, r: str) -> set[int]:
    return set(w.receivers[r].storage.values())


def attempts(w: World, epoch: int = 1) -> list[msg.Prepare]:
    return w.calls(msg.Prepare, f"c{epoch}")


def _is_call(c: object, kind: type) -> bool:
    return isinstance(c, cmd.Call) and isinstance(c.message, kind)


def committed_everywhere(w: World, receivers: tuple[str, ...]) -> None:
    for r in receivers:
        rx = w.receivers[r]
        assert storage(w, r) == {V1}, (r, rx.storage)
        assert rx.gate_open and rx.core.phase is ReceiverPhase.READY
    assert all(o.baseline == V1 for o in w.owners.values())


def some_write_landed(w: World) -> bool:
    return any(V1 in storage(w, r) for r in w.receiver_names)


@pytest.mark.parametrize("sync", [True, False])
def test_happy_path(sync: bool) -> None:
    w = make(sync=sync)
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED
    assert w.record == CommitRecord(version=1, candidate="g1.100")
    committed_everywhere(w, w.receiver_names)
    # The gates reopen once the commit succeeded, before the owners' baseline updates (which
    # only the next transition needs); the transition ends only after every owner's report.
    log = [c for _, c in w.log]
    commit = next(i for i, c in enumerate(log) if isinstance(c, cmd.CompareAndSet))
    reports = [
        i for i, c in enumerate(log)
        if isinstance(c, cmd.Notify) and isinstance(c.message, msg.BaselineUpdated)
    ]  # fmt: skip
    reopen = min(i for i, c in enumerate(log) if _is_call(c, msg.ReopenGate))
    ended = next(i for i, c in enumerate(log) if isinstance(c, cmd.TransitionEnded))
    assert commit < reopen < min(reports) and len(reports) == len(w.owners)
    assert max(reports) < ended
    if not sync:
        # Asynchronous RL: the gate closes only after every receiver staged every payload.
        staged = [i for i, (_, c) in enumerate(w.log)
                  if isinstance(c, cmd.Notify) and isinstance(c.message, msg.Staged)]  # fmt: skip
        gate = min(i for i, (_, c) in enumerate(w.log) if _is_call(c, msg.WaitForRequests))
        assert len(staged) == len(w.receiver_names) and max(staged) < gate


def test_receiver_killed_mid_stream_is_retired_then_rejoins_by_dense_refit() -> None:
    """Paper Figure B.5: r2 fails in tau1, is not required in tau2, joins tau3 after a refit."""
    w = make()
    w.run(until=some_write_landed)
    w.crash_receiver("r2")
    assert storage(w, "r2") == {LOST}
    w.run(until=lambda w: len(attempts(w)) == 2)
    tau2 = attempts(w)[1].info
    assert tau2.mode is Mode.OVERWRITE and "r2" not in tau2.receivers
    w.dense_refit("r2")  # restores K^v; ReceiverReady reaches the coordinator
    w.run(until=lambda w: w.coordinators[1].attempt_phase is AttemptPhase.GATING)
    expire(w, Stage.GATE, tau2.attempt)  # tau2 fails too
    w.run()
    tau3 = attempts(w)[2].info
    assert "r2" in tau3.receivers and tau3.mode is Mode.OVERWRITE
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def _cas_in_flight(w: World) -> bool:
    return any(m.kind is Kind.STORE and isinstance(m.event, cmd.CompareAndSet) for m in w.messages)


def _index(w: World, pred: Callable[[Message], bool]) -> int:
    [i] = w.indices(pred)[:1]
    return i


def test_lost_commit_reply_is_resolved_by_read_commit_only_after_the_deadline() -> None:
    w = make()
    w.run(until=_cas_in_flight)
    w.deliver(_index(w, lambda m: m.kind is Kind.STORE))  # the commit takes effect
    w.lose_commit_reply(_index(w, lambda m: isinstance(m.event, ev.CommitReplied)))
    w.run()
    c = w.coordinators[1]
    assert c.attempt_phase is AttemptPhase.UNKNOWN and not w.commands(cmd.ReadCommit)
    expire(w, Stage.COMMIT)
    assert w.commands(cmd.ReadCommit)
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED and len(attempts(w)) == 1
    committed_everywhere(w, w.receiver_names)


def test_commit_that_misses_its_deadline_fails_and_the_overwrite_retry_commits() -> None:
    w = make()
    w.run(until=_cas_in_flight)
    expire(w, Stage.COMMIT)  # no reply yet: unknown, and the deadline has passed
    assert w.coordinators[1].attempt_phase is AttemptPhase.RESOLVING
    w.run()  # the late compare-and-set is refused; read_commit sees K^v
    assert w.outcome() is TransitionOutcome.COMMITTED
    [first, retry] = [p.info for p in attempts(w)]
    assert (first.mode, retry.mode) == (Mode.MIXED, Mode.OVERWRITE)
    assert w.record == retry.target
    committed_everywhere(w, w.receiver_names)


def test_failover_after_the_old_commit_took_effect_finishes_it_and_returns_conflict() -> None:
    w = make()
    w.run(until=_cas_in_flight)
    w.deliver(_index(w, lambda m: m.kind is Kind.STORE))  # commit lands, reply in flight
    w.take_over(kill_old=True)
    w.run()
    new = w.coordinators[2]
    assert new.phase is TransitionPhase.COMMITTED and w.outcome(2) is TransitionOutcome.CONFLICT
    assert w.record.candidate == "g1.100"  # the old coordinator's candidate
    assert not w.calls(msg.Prepare, "c2")  # no retry
    committed_everywhere(w, w.receiver_names)


def test_failover_before_commit_retries_in_overwrite_and_the_old_coordinator_stands_down() -> None:
    w = make()
    w.run(until=lambda w: w.coordinators[1].attempt_phase is AttemptPhase.FLUSHING)
    w.take_over(kill_old=False)  # the old coordinator keeps running
    w.run()
    while old_timers := [i for i, (epoch, _, _) in enumerate(w.timers) if epoch == 1]:
        w.expire(old_timers[0])  # the old coordinator times out and retries
        w.run()
    assert w.outcome(1) is TransitionOutcome.CONFLICT
    assert w.outcome(2) is TransitionOutcome.COMMITTED
    [retry] = attempts(w, 2)
    assert retry.info.mode is Mode.OVERWRITE and w.record == retry.info.target
    # A replaced coordinator never commits and never touches the gate.
    assert not w.calls(msg.ReopenGate, "c1")
    assert w.commit_epoch == 2
    committed_everywhere(w, w.receiver_names)


def test_conflicting_duplicate_fails_the_attempt_and_the_overwrite_retry_repairs() -> None:
    w = make(payloads=1)
    w.run(until=lambda w: bool(w.indices(lambda m: m.kind is Kind.PAYLOAD and m.to == "r1")))
    i = _index(w, lambda m: m.kind is Kind.PAYLOAD and m.to == "r1")
    w.corrupt(i, conflicting=True)  # same id, other bytes, arrives first
    w.run()
    failures = [
        c.message for c in w.commands(cmd.Notify, "r1") if isinstance(c.message, msg.AttemptFailed)
    ]
    assert [f.check for f in failures] == ["conflicting-duplicate"]
    assert [p.info.mode for p in attempts(w)] == [Mode.MIXED, Mode.OVERWRITE]
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def test_payloads_of_an_obsolete_attempt_arriving_late_are_dropped() -> None:
    w = make()
    first = lambda m: m.kind is Kind.PAYLOAD and m.to == "r0" and m.event.key.attempt == 100  # noqa: E731
    w.run(until=lambda w: w.coordinators[1].attempt_phase is AttemptPhase.APPLYING, hold=first)
    expire(w, Stage.FLUSH)  # r0 never got tau1's payloads: the attempt fails
    w.run(until=lambda w: len(attempts(w)) == 2, hold=first)
    late = w.indices(first)
    assert late
    before = dict(w.receivers["r0"].storage)
    for _ in late:
        w.deliver(w.indices(first)[0])
    assert w.receivers["r0"].storage == before
    assert any(c.reason == "not the active attempt" for c in w.commands(cmd.Discard, "r0"))
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def test_operator_abort_keeps_the_gate_closed_until_a_dense_refit() -> None:
    w = make()
    w.run(until=some_write_landed)
    w.operator_abort("loader wrote outside the hook")
    w.run()
    c = w.coordinators[1]
    assert c.phase is TransitionPhase.REFITTING
    [request] = w.commands(cmd.RequestDenseRefit)
    dirty = sorted(request.receivers)
    assert dirty and all(not w.receivers[r].gate_open for r in dirty)
    for r in dirty:
        w.dense_refit(r)
        w.run()
    assert w.outcome() is TransitionOutcome.ABORTED and w.record == w.base
    for r in w.receiver_names:
        assert storage(w, r) == {V0} and w.receivers[r].gate_open
    assert all(o.baseline == V0 for o in w.owners.values())


def test_rejection_before_admission_ends_the_transition_with_v_committed() -> None:
    w = make()
    w.run(until=lambda w: bool(w.indices(lambda m: isinstance(m.event, msg.Prepare))))
    w.reject_prepare(_index(w, lambda m: m.to == "r1" and isinstance(m.event, msg.Prepare)),
                     "classification")  # fmt: skip
    w.run()
    assert w.outcome() is TransitionOutcome.REJECTED and w.record == w.base
    assert len(attempts(w)) == 1
    assert all(storage(w, r) == {V0} and w.receivers[r].gate_open for r in w.receiver_names)


def test_failure_before_admission_retries_prepare_in_mixed_mode() -> None:
    w = make()
    w.run(until=lambda w: bool(w.indices(lambda m: isinstance(m.event, msg.Prepare))))
    w.drop(_index(w, lambda m: m.to == "o1" and isinstance(m.event, msg.Prepare)))
    w.run()
    expire(w, Stage.PREPARE)
    w.run()
    assert [p.info.mode for p in attempts(w)] == [Mode.MIXED, Mode.MIXED]
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def test_failure_after_admission_retries_in_overwrite_mode_and_repairs_partial_writes() -> None:
    w = make()
    w.run(until=some_write_landed)
    mixture = storage(w, "r0") | storage(w, "r1") | storage(w, "r2")
    assert mixture == {V0, V1}
    expire(w, Stage.FLUSH)
    w.run()
    assert [p.info.mode for p in attempts(w)] == [Mode.MIXED, Mode.OVERWRITE]
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def test_a_takeover_whose_endpoints_all_stopped_before_the_obsolete_mark_reads_the_commit() -> None:
    """Stops and retirements of the old attempt may all arrive while the new coordinator is
    still marking it obsolete (replies to the replaced coordinator's stop): entering the stop
    must see that nothing is left to wait for, or the takeover waits forever (found by the
    heavy state machine)."""
    from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
    from dcr.protocol.types import AttemptInfo, CounterIds, Timeouts

    base = CommitRecord(version=0, candidate="g0")
    old = AttemptInfo(
        attempt=100, candidate="g1.100", base=base, mode=Mode.MIXED, sync=False,
        coordinator=1, owners=("o0",), receivers=frozenset({"r0", "r1"}),
    )  # fmt: skip
    core = CoordinatorCore(
        CoordinatorConfig(base=base, owners=("o0",), receivers=("r0", "r1"), epoch=2,
                          sync=False, timeouts=Timeouts()),
        CounterIds(first=200, prefix="g2."),
    )  # fmt: skip
    out = core.handle(ev.TakeOver(old=old))
    assert any(isinstance(c, cmd.RecordObsolete) for c in out)
    for event in (
        msg.Retired(attempt=100, endpoint="o0"),
        msg.Stopped(attempt=100, endpoint="r0"),
        msg.Stopped(attempt=100, endpoint="r1"),
    ):
        assert not any(isinstance(c, cmd.ReadCommit) for c in core.handle(event))
    assert core.attempt_phase is AttemptPhase.OBSOLETE
    out = core.handle(ev.ObsoleteMarked(attempt=100))
    assert [c for c in out if isinstance(c, cmd.ReadCommit)] == [cmd.ReadCommit(attempt=100)]
    assert core.phase is TransitionPhase.RESOLVING  # reading the commit record
