"""ReceiverCore: reception checks, dedupe, bounded queue, declared order, stop, gate,
back-pressure, the arrival check and dense refits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcr.errors import LocalProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey, Stage

K0 = CommitRecord(version=0, candidate="g0")


def info(
    tau: int = 1,
    *,
    mode: Mode = Mode.MIXED,
    sync: bool = True,
    owners: tuple[str, ...] = ("a", "b"),
    epoch: int = 1,
) -> AttemptInfo:
    return AttemptInfo(
        attempt=tau,
        candidate=f"g{tau}",
        base=K0,
        mode=mode,
        sync=sync,
        coordinator=epoch,
        owners=owners,
        receivers=frozenset({"r"}),
    )


def key(tau: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=tau, owner=owner, payload_id=pid)


class Engine:
    """Plays the receiver engine: numbers deliveries and runs the reception checks the core
    asks for (their outcome is fixed when the payload is handed over)."""

    def __init__(self, core: ReceiverCore) -> None:
        self.core = core
        self.count = 0
        self.pending: dict[int, ev.PayloadArrived] = {}
        self.checked: list[int] = []

    def arrive(
        self, tau: int, owner: str, pid: int, *, final: bool = False,
        digest: bytes | None = None, rejection: str | None = None,
    ) -> list[cmd.ReceiverCommand]:  # fmt: skip
        self.count += 1
        k = key(tau, owner, pid)
        self.pending[self.count] = ev.PayloadArrived(
            delivery=self.count,
            key=k,
            digest=digest if digest is not None else f"{owner}{pid}".encode(),
            final=final,
            rejection=rejection,
        )
        return self.handle(ev.PayloadReceived(delivery=self.count, key=k))

    def handle(self, event: ev.ReceiverEvent) -> list[cmd.ReceiverCommand]:
        return self.run(self.core.handle(event))

    def run(self, out: Sequence[cmd.ReceiverCommand]) -> list[cmd.ReceiverCommand]:
        result = list(out)
        for c in out:
            if isinstance(c, cmd.CheckPayload):
                self.checked.append(c.delivery)
                result += self.run(self.core.handle(self.pending.pop(c.delivery)))
        return result


def of(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c for c in commands if isinstance(c, kind)]


def notified(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c.message for c in of(commands, cmd.Notify) if isinstance(c.message, kind)]


def prepared(i: AttemptInfo | None = None, **kwargs: object) -> Engine:
    r = ReceiverCore("r", held=K0, **kwargs)  # type: ignore[arg-type]
    out = r.handle(msg.Prepare(info=i or info()))
    assert notified(out, msg.PrepareAccepted)
    return Engine(r)


def gated_and_open(e: Engine, tau: int = 1) -> list[object]:
    out: list[object] = []
    out += e.handle(msg.WaitForRequests(attempt=tau, epoch=1))
    assert of(out, cmd.CloseGate) and not e.core.gate_open
    out += e.handle(ev.RequestsDrained(attempt=tau))
    assert notified(out, msg.GateClosed)
    out += e.handle(msg.OpenApply(attempt=tau, epoch=1))
    return out


def test_identical_duplicate_is_ignored_and_a_conflicting_one_fails_the_attempt() -> None:
    e = prepared()
    assert of(e.arrive(1, "a", 0), cmd.StagePayload)
    again = e.arrive(1, "a", 0)
    assert [c.reason for c in of(again, cmd.Discard)] == ["duplicate"]
    assert not notified(again, msg.AttemptFailed)
    clash = e.arrive(1, "a", 0, digest=b"other bytes")
    [failure] = notified(clash, msg.AttemptFailed)
    assert failure.check == "conflicting-duplicate" and e.core.phase is ReceiverPhase.FAILED
    later = e.arrive(1, "b", 0)
    assert of(later, cmd.Discard) and not of(later, cmd.CheckPayload)  # nothing more is taken


def test_a_payload_that_failed_reception_checks_fails_the_attempt_before_apply() -> None:
    e = prepared()
    out = e.arrive(1, "a", 0, rejection="digest")
    [failure] = notified(out, msg.AttemptFailed)
    assert failure.check == "digest" and not of(out, cmd.StagePayload)
    assert [c.delivery for c in of(out, cmd.Discard)] == [1]  # its bytes are dropped


def test_payloads_of_other_and_obsolete_attempts_are_dropped_unread() -> None:
    e = prepared(info(2))
    for tau in (1, 3):  # an older attempt, one never prepared here
        out = e.arrive(tau, "a", 0)
        assert of(out, cmd.Discard) and not of(out, cmd.CheckPayload)
    e.handle(msg.MarkObsolete(attempt=2, epoch=1))
    assert e.core.phase is ReceiverPhase.OBSOLETE
    out = e.arrive(2, "a", 0)
    assert of(out, cmd.Discard) and not of(out, cmd.StagePayload)
    assert not of(e.handle(msg.OpenApply(attempt=2, epoch=1)), cmd.Apply)


def test_application_follows_declared_order_not_arrival_order() -> None:
    e = prepared()
    applies: list[PayloadKey] = []

    def run(out: Sequence[object]) -> None:
        # The engine decodes at once and completes applies one group at a time.
        for c in out:
            if isinstance(c, cmd.Decode):
                run(e.handle(ev.PayloadDecoded(key=c.key)))
            elif isinstance(c, cmd.Apply):
                applies.extend(c.keys)
                run(e.handle(ev.PayloadsApplied(attempt=1, keys=c.keys)))

    run(gated_and_open(e))
    for owner, pid, final in [("b", 1, True), ("a", 1, False), ("b", 0, False), ("a", 2, True)]:
        run(e.arrive(1, owner, pid, final=final))
    assert applies == []  # (0, a) has not arrived: nothing may be applied before it
    run(e.arrive(1, "a", 0))
    assert applies == [
        key(1, "a", 0),
        key(1, "b", 0),
        key(1, "a", 1),
        key(1, "b", 1),
        key(1, "a", 2),
    ]
    out = e.handle(msg.Flush(attempt=1, expected=(("a", 3), ("b", 2))))
    assert of(out, cmd.Synchronize)
    [ack] = notified(e.handle(ev.Synchronized(attempt=1)), msg.Acked)
    assert ack.applied == (("a", 3), ("b", 2)) and e.core.phase is ReceiverPhase.ACKED


def test_synchronous_mode_decodes_early_but_applies_only_after_open_apply() -> None:
    e = prepared()
    out = e.arrive(1, "a", 0, final=True)
    [stage] = of(out, cmd.StagePayload)
    assert stage.keep_decoded  # the reception check's decode is reused
    [decode] = of(out, cmd.Decode)
    assert not of(e.handle(ev.PayloadDecoded(key=decode.key)), cmd.Apply)
    opened = gated_and_open(e)
    assert [c.keys for c in of(opened, cmd.Apply)] == [(key(1, "a", 0),)]


def test_asynchronous_mode_stages_while_serving_and_decodes_after_the_gate() -> None:
    e = prepared(info(sync=False))
    staged: list[object] = []
    staged += e.arrive(1, "b", 0, final=True)
    staged += e.arrive(1, "a", 0, final=True)
    assert of(staged, cmd.StagePayload) and not of(staged, cmd.Decode)
    # The reception check's decode is kept while the bounded queue has room: nothing is
    # decoded twice, and nothing under the closed gate.
    assert all(c.keep_decoded for c in of(staged, cmd.StagePayload))
    assert e.core.gate_open  # still serving version v
    [report] = notified(staged, msg.Staged)
    assert report.counts == (("a", 1), ("b", 1))
    out = gated_and_open(e)
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 0), key(1, "b", 0)]


def test_asynchronous_mode_keeps_only_the_decodes_the_queue_holds() -> None:
    """Kept decodes take the queue's slots but one, which stays free for the declared order's
    next payload; past that a staged payload is held compressed and decoded under the gate
    once a slot frees."""
    e = prepared(info(sync=False), queue=QueueConfig(groups=2, group_size=1))
    assert e.core.queue.capacity == 3
    staged: list[object] = []
    for owner, pid, final in (("b", 0, True), ("a", 0, False), ("a", 1, False), ("a", 2, True)):
        staged += e.arrive(1, owner, pid, final=final)
    assert [c.keep_decoded for c in of(staged, cmd.StagePayload)] == [True, True, False, False]
    assert not of(staged, cmd.Decode) and e.core.gate_open
    out = gated_and_open(e)
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 0), key(1, "b", 0), key(1, "a", 1)]
    [apply] = of(e.handle(ev.PayloadDecoded(key=key(1, "a", 0))), cmd.Apply)
    assert apply.keys == (key(1, "a", 0),)  # one payload per group here
    out = e.handle(ev.PayloadsApplied(attempt=1, keys=apply.keys))
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 2)]  # its slot freed


def test_a_full_queue_parks_later_payloads_unread_and_lets_the_next_one_through() -> None:
    e = prepared(info(owners=("a",)), queue=QueueConfig(groups=1, group_size=1))
    assert e.core.queue.capacity == 2
    out = e.arrive(1, "a", 1)
    assert of(out, cmd.Decode)  # one slot for later payloads
    out = e.arrive(1, "a", 2)
    assert not of(out, cmd.Decode)  # the last slot is reserved for payload 0
    assert not e.core.reading
    out = e.arrive(1, "a", 3, final=True)
    # Parked: not checked, hence not acknowledged to the transport (owners slow down).
    assert not of(out, cmd.CheckPayload) and e.core.parked == 1
    out = e.arrive(1, "a", 0)
    assert of(out, cmd.CheckPayload)  # the payload the declared order needs passes
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 0)]  # the reserved slot


def test_flush_checks_arrival_against_the_declared_sent_lists() -> None:
    e = prepared()
    gated_and_open(e)
    e.arrive(1, "a", 0, final=True)
    out = e.handle(msg.Flush(attempt=1, expected=(("a", 2), ("b", 1))))
    [failure] = notified(out, msg.AttemptFailed)
    assert failure.check == "arrival"


def test_missing_payloads_fail_the_attempt_once_the_arrival_grace_passed() -> None:
    e = prepared(info(owners=("a",)), arrival_grace_s=2.5)
    gated_and_open(e)
    e.arrive(1, "a", 0)
    out = e.handle(msg.Flush(attempt=1, expected=(("a", 2),)))
    # The core arms its own deadline instead of the engine sleeping and inventing an event.
    assert of(out, cmd.ArmDeadline) == [
        cmd.ArmDeadline(attempt=1, stage=Stage.ARRIVAL, seconds=2.5)
    ]
    assert not notified(out, msg.AttemptFailed)
    [failure] = notified(
        e.handle(ev.DeadlineExpired(attempt=1, stage=Stage.ARRIVAL)), msg.AttemptFailed
    )
    assert failure.check == "missing" and "a/1" in failure.message


def test_a_late_payload_within_the_grace_passes_the_arrival_check() -> None:
    e = prepared(info(owners=("a",)), arrival_grace_s=2.5)
    gated_and_open(e)
    e.arrive(1, "a", 0)
    e.handle(msg.Flush(attempt=1, expected=(("a", 2),)))
    e.arrive(1, "a", 1, final=True)
    assert not notified(
        e.handle(ev.DeadlineExpired(attempt=1, stage=Stage.ARRIVAL)), msg.AttemptFailed
    )


def test_without_grace_a_missing_payload_fails_at_flush() -> None:
    e = prepared(info(owners=("a",)))
    gated_and_open(e)
    e.arrive(1, "a", 0)
    [failure] = notified(e.handle(msg.Flush(attempt=1, expected=(("a", 2),))), msg.AttemptFailed)
    assert failure.check == "missing"


def test_asynchronous_arrival_check_fails_fast_for_a_dropped_payload() -> None:
    e = prepared(info(sync=False, owners=("a",)), arrival_grace_s=1.0)
    e.arrive(1, "a", 1, final=True)  # payload 0 was lost on the way
    out = e.handle(msg.CheckArrival(attempt=1, expected=(("a", 2),)))
    assert of(out, cmd.ArmDeadline)
    [failure] = notified(
        e.handle(ev.DeadlineExpired(attempt=1, stage=Stage.ARRIVAL)), msg.AttemptFailed
    )
    assert failure.check == "missing"


def test_stop_and_wait_answers_only_after_pending_writes_finish() -> None:
    e = prepared(info(owners=("a",)))
    e.arrive(1, "a", 0, final=True)
    gated_and_open(e)
    [apply] = of(e.handle(ev.PayloadDecoded(key=key(1, "a", 0))), cmd.Apply)
    e.handle(msg.MarkObsolete(attempt=1, epoch=1))
    assert not notified(e.handle(msg.StopAndWait(attempt=1, epoch=1)), msg.Stopped)
    [stopped] = notified(e.handle(ev.PayloadsApplied(attempt=1, keys=apply.keys)), msg.Stopped)
    assert stopped.dirty and e.core.phase is ReceiverPhase.STOPPED
    assert of(e.handle(msg.Cleanup(attempt=1)), cmd.Release)
    assert notified(e.handle(msg.StopAndWait(attempt=9, epoch=1)), msg.Stopped)


def test_partially_written_storage_refuses_mixed_mode_and_takes_overwrite() -> None:
    e = prepared(info(owners=("a",)))
    e.arrive(1, "a", 0, final=True)
    gated_and_open(e)
    e.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    e.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),), failure="loader"))
    for call in (msg.StopAndWait(attempt=1, epoch=1), msg.Cleanup(attempt=1)):
        e.handle(call)
    assert e.core.dirty and e.core.phase is ReceiverPhase.CLEANED
    [failure] = notified(e.handle(msg.Prepare(info=info(2, owners=("a",)))), msg.AttemptFailed)
    assert failure.check == "mode"
    out = e.handle(msg.Prepare(info=info(3, mode=Mode.OVERWRITE, owners=("a",))))
    assert notified(out, msg.PrepareAccepted)


def test_gate_reopens_only_at_a_record_the_receiver_holds_and_after_kv_invalidation() -> None:
    e = prepared(info(owners=("a",)))
    e.arrive(1, "a", 0, final=True)
    gated_and_open(e)
    e.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    e.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),)))
    e.handle(msg.Flush(attempt=1, expected=(("a", 1),)))
    e.handle(ev.Synchronized(attempt=1))
    e.handle(msg.Cleanup(attempt=1))
    wrong = CommitRecord(version=1, candidate="someone-else")
    refused = e.handle(msg.ReopenGate(attempt=1, epoch=1, record=wrong))
    assert notified(refused, msg.AttemptFailed) and not e.core.gate_open
    assert e.handle(msg.ReopenGate(attempt=1, epoch=0, record=info().target)) == []
    out = e.handle(msg.ReopenGate(attempt=1, epoch=1, record=info().target))
    assert [type(c) for c in out] == [cmd.InvalidateKvCache, cmd.OpenGate]
    assert e.core.gate_open and e.core.held == info().target
    assert e.core.phase is ReceiverPhase.READY


def test_a_restarted_receiver_joins_only_after_a_dense_refit_of_the_committed_record() -> None:
    r = ReceiverCore("r", held=None)
    assert r.phase is ReceiverPhase.JOINING
    assert not r.gate_open and r.held is None
    [failure] = notified(r.handle(msg.Prepare(info=info())), msg.AttemptFailed)
    assert failure.check == "joining"
    [ready] = notified(r.handle(ev.DenseRefitDone(record=K0)), msg.ReceiverReady)
    assert ready.record == K0 and r.held == K0 and not r.gate_open
    assert notified(r.handle(msg.Prepare(info=info())), msg.PrepareAccepted)


def _dense(e: Engine, job: int, record: CommitRecord, counts: dict[str, int]) -> list[object]:
    """Deliver a dense job's payloads -- each owner's in the order it sends them, the owners
    interleaved against the declared order -- and complete the work the core asks for."""
    out: list[object] = []
    arrivals = [(o, p, p == n - 1) for o, n in reversed(counts.items()) for p in range(n)]
    for owner, pid, final in sorted(arrivals, key=lambda a: a[1]):
        out += e.arrive(job, owner, pid, final=final)
    for _ in range(100):
        todo = [c for c in out if isinstance(c, cmd.Decode | cmd.Apply | cmd.Synchronize)]
        if not todo:
            break
        for c in todo:
            out.remove(c)
            if isinstance(c, cmd.Decode):
                out += e.handle(ev.PayloadDecoded(key=c.key))
            elif isinstance(c, cmd.Apply):
                out += e.handle(ev.PayloadsApplied(attempt=job, keys=c.keys))
            else:
                out += e.handle(ev.Synchronized(attempt=job))
    return out


def test_a_joining_receiver_restores_the_record_from_a_dense_refit_over_the_transport() -> None:
    e = Engine(ReceiverCore("r", held=None))
    call = msg.DenseRefit(job=77, record=K0, owners=("a", "b"), receivers=frozenset({"r"}))
    assert e.handle(call) == []
    out = _dense(e, 77, K0, {"a": 2, "b": 1})
    applied = [k for c in of(out, cmd.Apply) for k in c.keys]
    assert applied == []  # every Apply was completed inside _dense
    [ready] = notified(out, msg.ReceiverReady)
    assert ready.record == K0 and e.core.held == K0 and not e.core.dirty
    assert e.core.phase is ReceiverPhase.REFITTED and e.core.dense_job is None
    assert notified(e.handle(msg.Prepare(info=info())), msg.PrepareAccepted)


def test_a_receiver_that_fell_behind_is_dense_refitted_to_the_newer_record() -> None:
    k1 = CommitRecord(version=1, candidate="g1")
    e = Engine(ReceiverCore("r", held=None))
    e.handle(msg.DenseRefit(job=4, record=K0, owners=("a",), receivers=frozenset({"r"})))
    assert notified(_dense(e, 4, K0, {"a": 1}), msg.ReceiverReady)
    # v1 was committed while it restored v0: it restores v1 before it joins (App. B.2).
    e.handle(msg.DenseRefit(job=5, record=k1, owners=("a",), receivers=frozenset({"r"})))
    out = _dense(e, 5, k1, {"a": 1})
    assert notified(out, msg.ReceiverReady) and e.core.held == k1
    assert e.core.phase is ReceiverPhase.REFITTED and not e.core.gate_open


def test_a_dense_job_with_a_corrupt_payload_fails_and_a_newer_job_replaces_it() -> None:
    e = Engine(ReceiverCore("r", held=None))
    e.handle(msg.DenseRefit(job=1, record=K0, owners=("a",), receivers=frozenset({"r"})))
    [failure] = notified(e.arrive(1, "a", 0, final=True, rejection="digest"), msg.AttemptFailed)
    assert failure.attempt == 1 and failure.check == "digest" and e.core.dense_job is None
    e.handle(msg.DenseRefit(job=2, record=K0, owners=("a",), receivers=frozenset({"r"})))
    assert e.core.dense_job == 2
    assert notified(_dense(e, 2, K0, {"a": 1}), msg.ReceiverReady)


def test_a_dense_payload_lost_in_transit_fails_the_job_once_the_arrival_grace_passed() -> None:
    e = Engine(ReceiverCore("r", held=None, arrival_grace_s=1.0))
    e.handle(msg.DenseRefit(job=3, record=K0, owners=("a", "b"), receivers=frozenset({"r"})))
    e.arrive(3, "a", 0, final=True)  # b's only payload was lost with a relay node
    out = e.handle(msg.CheckArrival(attempt=3, expected=(("a", 1), ("b", 1))))
    [deadline] = of(out, cmd.ArmDeadline)
    assert deadline.stage is Stage.ARRIVAL and not notified(out, msg.AttemptFailed)
    out = e.handle(ev.DeadlineExpired(attempt=3, stage=Stage.ARRIVAL))
    [failure] = notified(out, msg.AttemptFailed)
    assert (failure.attempt, failure.check) == (3, "missing") and "b/0" in failure.message
    assert of(out, cmd.Release) and e.core.dense_job is None and e.core.held is None


def test_a_dense_job_whose_payloads_all_arrived_passes_the_arrival_check() -> None:
    e = Engine(ReceiverCore("r", held=None, arrival_grace_s=1.0))
    e.handle(msg.DenseRefit(job=3, record=K0, owners=("a",), receivers=frozenset({"r"})))
    out = e.handle(msg.CheckArrival(attempt=3, expected=(("a", 2),)))
    assert of(out, cmd.ArmDeadline)  # nothing arrived yet: wait for the grace
    out = _dense(e, 3, K0, {"a": 2})
    assert notified(out, msg.ReceiverReady) and e.core.held == K0
    assert e.handle(ev.DeadlineExpired(attempt=3, stage=Stage.ARRIVAL)) == []


def test_a_receiver_in_an_attempt_refuses_a_dense_refit() -> None:
    e = prepared()
    call = msg.DenseRefit(job=9, record=K0, owners=("a",), receivers=frozenset({"r"}))
    [failure] = notified(e.handle(call), msg.AttemptFailed)
    assert failure.check == "busy" and e.core.dense_job is None
    other = msg.DenseRefit(job=9, record=K0, owners=("a",), receivers=frozenset({"x"}))
    assert e.handle(other) == []  # addressed to somebody else


def test_late_prepare_of_a_stopped_attempt_and_replaced_coordinator_are_refused() -> None:
    r = ReceiverCore("r", held=K0)
    assert notified(r.handle(msg.StopAndWait(attempt=5, epoch=2)), msg.Stopped)
    [stale] = notified(r.handle(msg.Prepare(info=info(5, epoch=2))), msg.AttemptFailed)
    assert stale.check == "stale"
    [old] = notified(r.handle(msg.Prepare(info=info(6, epoch=1))), msg.AttemptFailed)
    assert old.check == "epoch"


def test_engine_contract_violation_raises_local_protocol_error() -> None:
    r = prepared().core
    with pytest.raises(LocalProtocolError):
        r.handle(ev.DenseRefitDone(record=K0))  # a receiver in an attempt is never refitted
    assert r.phase is ReceiverPhase.PREPARED


@given(
    owners=st.integers(min_value=1, max_value=3),
    per_owner=st.lists(st.integers(min_value=1, max_value=6), min_size=3, max_size=3),
    groups=st.integers(min_value=1, max_value=2),
    group_size=st.integers(min_value=1, max_value=3),
    sync=st.booleans(),
    data=st.data(),
)
def test_any_arrival_order_applies_in_declared_order_within_the_queue_bound(
    owners: int,
    per_owner: list[int],
    groups: int,
    group_size: int,
    sync: bool,
    data: st.DataObject,
) -> None:
    names = tuple("abc"[:owners])
    counts = dict(zip(names, per_owner, strict=False))
    queue = QueueConfig(groups=groups, group_size=group_size)
    r = ReceiverCore("r", held=K0, queue=queue)
    r.handle(msg.Prepare(info=info(owners=names, sync=sync)))
    arrivals = [(o, p, p == counts[o] - 1) for o in names for p in range(counts[o])]
    arrivals = data.draw(st.permutations(arrivals))
    by_delivery = {}
    pending: list[ev.ReceiverEvent] = []
    held: set[PayloadKey] = set()
    checking: set[int] = set()
    applied: list[PayloadKey] = []

    def run(out: Sequence[object]) -> None:
        for c in out:
            if isinstance(c, cmd.CheckPayload):
                checking.add(c.delivery)
                pending.append(by_delivery[c.delivery])
            elif isinstance(c, cmd.StagePayload):
                held.add(c.key)
            elif isinstance(c, cmd.Decode):
                pending.append(ev.PayloadDecoded(key=c.key))
            elif isinstance(c, cmd.Apply):
                assert len(c.keys) <= queue.group_size
                applied.extend(c.keys)
                pending.append(ev.PayloadsApplied(attempt=1, keys=c.keys))
            elif isinstance(c, cmd.CloseGate):
                pending.append(ev.RequestsDrained(attempt=1))
            elif isinstance(c, cmd.Synchronize):
                pending.append(ev.Synchronized(attempt=1))
            if sync:
                # The bounded queue: payloads being checked, staged or decoded never exceed
                # its capacity, plus the one the declared order needs next and the group
                # being applied.
                assert len(held) + len(checking) <= queue.capacity + 1 + queue.group_size

    def complete(e: ev.ReceiverEvent) -> None:
        if isinstance(e, ev.PayloadsApplied):
            held.difference_update(e.keys)
        if isinstance(e, ev.PayloadArrived):
            checking.discard(e.delivery)
        run(r.handle(e))

    def complete_some() -> None:
        while pending:
            if not data.draw(st.booleans()):
                return
            complete(pending.pop(data.draw(st.integers(0, len(pending) - 1))))

    if sync:
        run(r.handle(msg.WaitForRequests(attempt=1, epoch=1)))
        run(r.handle(msg.OpenApply(attempt=1, epoch=1)))
    for n, (o, p, final) in enumerate(arrivals, start=1):
        k = key(1, o, p)
        by_delivery[n] = ev.PayloadArrived(
            delivery=n, key=k, digest=f"{o}{p}".encode(), final=final
        )
        run(r.handle(ev.PayloadReceived(delivery=n, key=k)))
        complete_some()
    while pending:
        complete(pending.pop(0))
    if not sync:
        run(r.handle(msg.WaitForRequests(attempt=1, epoch=1)))
        run(r.handle(msg.OpenApply(attempt=1, epoch=1)))
    run(r.handle(msg.Flush(attempt=1, expected=tuple(counts.items()))))
    while pending:
        complete(pending.pop(0))
    declared = sorted(
        (key(1, o, p) for o in names for p in range(counts[o])),
        key=lambda k: (k.payload_id, names.index(k.owner)),
    )
    assert applied == declared
    assert r.phase is ReceiverPhase.ACKED and r.applied == tuple(counts.items())
    assert r.parked == 0


def test_paused_ingestion_follows_the_next_payload_in_declared_order() -> None:
    """With the queue full of later payloads, ingestion lets through exactly the payload the
    declared order needs next -- and follows it each time the cursor moves on."""
    e = prepared(info(owners=("a",)), queue=QueueConfig(groups=1, group_size=1))  # capacity 2
    gated_and_open(e)
    e.arrive(1, "a", 3, final=True)
    e.arrive(1, "a", 2)
    assert not e.core.reading
    out = e.arrive(1, "a", 1)
    assert not of(out, cmd.CheckPayload) and e.core.parked == 1  # not the one needed next
    out = e.arrive(1, "a", 0)
    assert of(out, cmd.Decode) == [cmd.Decode(key=key(1, "a", 0))]
    out = e.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    assert of(out, cmd.Apply) == [cmd.Apply(attempt=1, keys=(key(1, "a", 0),))]
    out = e.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),)))
    # the cursor moved to a/1, which is parked: it is let through now
    assert [c.delivery for c in of(out, cmd.CheckPayload)] == [3] and e.core.parked == 0
    assert of(out, cmd.Decode) == [cmd.Decode(key=key(1, "a", 1))]


def test_parked_deliveries_leave_one_credit_of_the_transport_window_free() -> None:
    """A transport with credit hands over at most ``window`` unacknowledged deliveries; the
    core keeps one of them free so that the payload needed next can still get through."""
    e = prepared(info(owners=("a",)), queue=QueueConfig(groups=1, group_size=1), window=3)
    gated_and_open(e)
    e.arrive(1, "a", 9, final=True)
    e.arrive(1, "a", 8)  # the queue is full now: later deliveries are parked
    acks: list[int] = []
    for pid in (7, 6, 5, 4):
        out = e.arrive(1, "a", pid)
        assert not of(out, cmd.CheckPayload)
        acks += [c.delivery for c in of(out, cmd.Acknowledge)]
    # Four parked, at most window - 1 = 2 of them unacknowledged: the two oldest were
    # acknowledged unread (they stay parked in host memory).
    assert acks == [3, 4] and e.core.parked == 4
    out = e.arrive(1, "a", 0)
    assert of(out, cmd.CheckPayload)  # the credit left free carried it
