"""ReceiverCore: reception checks, dedupe, bounded queue, declared order, stop, gate."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcr.errors import LocalProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey

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


def arrived(
    tau: int, owner: str, pid: int, *, final: bool = False, digest: bytes | None = None,
    rejection: str | None = None,
) -> ev.PayloadArrived:  # fmt: skip
    return ev.PayloadArrived(
        attempt=tau,
        owner=owner,
        payload_id=pid,
        digest=digest if digest is not None else f"{owner}{pid}".encode(),
        final=final,
        rejection=rejection,
    )


def key(tau: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=tau, owner=owner, payload_id=pid)


def of(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c for c in commands if isinstance(c, kind)]


def notified(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c.event for c in of(commands, cmd.Notify) if isinstance(c.event, kind)]


def prepared(i: AttemptInfo | None = None) -> ReceiverCore:
    r = ReceiverCore("r", held=K0)
    out = r.handle(ev.PrepareRequested(info=i or info()))
    assert notified(out, ev.PrepareAccepted)
    return r


def gated_and_open(r: ReceiverCore, tau: int = 1) -> list[object]:
    out: list[object] = []
    out += r.handle(ev.WaitForRequestsRequested(attempt=tau, epoch=1))
    assert of(out, cmd.CloseGate) and not r.gate_open
    out += r.handle(ev.RequestsDrained(attempt=tau))
    assert notified(out, ev.GateClosed)
    out += r.handle(ev.OpenApplyRequested(attempt=tau, epoch=1))
    return out


def test_identical_duplicate_is_ignored_and_a_conflicting_one_fails_the_attempt() -> None:
    r = prepared()
    assert of(r.handle(arrived(1, "a", 0)), cmd.StagePayload)
    again = r.handle(arrived(1, "a", 0))
    assert [c.reason for c in of(again, cmd.Discard)] == ["duplicate"]
    assert not notified(again, ev.AttemptFailed)
    clash = r.handle(arrived(1, "a", 0, digest=b"other bytes"))
    [failure] = notified(clash, ev.AttemptFailed)
    assert failure.check == "conflicting-duplicate" and r.phase is ReceiverPhase.FAILED
    assert of(r.handle(arrived(1, "b", 0)), cmd.Discard)  # nothing more is taken


def test_a_payload_that_failed_reception_checks_fails_the_attempt_before_apply() -> None:
    r = prepared()
    out = r.handle(arrived(1, "a", 0, rejection="digest"))
    [failure] = notified(out, ev.AttemptFailed)
    assert failure.check == "digest" and not of(out, cmd.StagePayload)


def test_payloads_of_other_and_obsolete_attempts_are_dropped() -> None:
    r = prepared(info(2))
    assert of(r.handle(arrived(1, "a", 0)), cmd.Discard)  # an older attempt
    assert of(r.handle(arrived(3, "a", 0)), cmd.Discard)  # never prepared here
    r.handle(ev.MarkObsoleteRequested(attempt=2, epoch=1))
    assert r.phase is ReceiverPhase.OBSOLETE
    out = r.handle(arrived(2, "a", 0))
    assert of(out, cmd.Discard) and not of(out, cmd.StagePayload)
    assert not of(r.handle(ev.OpenApplyRequested(attempt=2, epoch=1)), cmd.Apply)


def test_application_follows_declared_order_not_arrival_order() -> None:
    r = prepared()
    applies: list[PayloadKey] = []

    def run(out: Sequence[object]) -> None:
        # The engine decodes at once and completes applies one group at a time.
        for c in out:
            if isinstance(c, cmd.Decode):
                run(r.handle(ev.PayloadDecoded(key=c.key)))
            elif isinstance(c, cmd.Apply):
                applies.extend(c.keys)
                run(r.handle(ev.PayloadsApplied(attempt=1, keys=c.keys)))

    run(gated_and_open(r))
    for owner, pid, final in [("b", 1, True), ("a", 1, False), ("b", 0, False), ("a", 2, True)]:
        run(r.handle(arrived(1, owner, pid, final=final)))
    assert applies == []  # (0, a) has not arrived: nothing may be applied before it
    run(r.handle(arrived(1, "a", 0)))
    assert applies == [
        key(1, "a", 0),
        key(1, "b", 0),
        key(1, "a", 1),
        key(1, "b", 1),
        key(1, "a", 2),
    ]
    out = r.handle(ev.FlushRequested(attempt=1, expected=(("a", 3), ("b", 2))))
    assert of(out, cmd.Synchronize)
    [ack] = notified(r.handle(ev.Synchronized(attempt=1)), ev.Acked)
    assert ack.applied == (("a", 3), ("b", 2)) and r.phase is ReceiverPhase.ACKED


def test_synchronous_mode_decodes_early_but_applies_only_after_open_apply() -> None:
    r = prepared()
    out = r.handle(arrived(1, "a", 0, final=True))
    [decode] = of(out, cmd.Decode)
    assert not of(r.handle(ev.PayloadDecoded(key=decode.key)), cmd.Apply)
    opened = gated_and_open(r)
    assert [c.keys for c in of(opened, cmd.Apply)] == [(key(1, "a", 0),)]


def test_asynchronous_mode_stages_while_serving_and_decodes_after_the_gate() -> None:
    r = prepared(info(sync=False))
    staged: list[object] = []
    staged += r.handle(arrived(1, "b", 0, final=True))
    staged += r.handle(arrived(1, "a", 0, final=True))
    assert of(staged, cmd.StagePayload) and not of(staged, cmd.Decode)
    assert r.gate_open  # still serving version v
    [report] = notified(staged, ev.Staged)
    assert report.counts == (("a", 1), ("b", 1))
    out = gated_and_open(r)
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 0), key(1, "b", 0)]


def test_bounded_queue_back_pressures_and_reserves_a_slot_for_the_next_payload() -> None:
    r = ReceiverCore("r", held=K0, queue=QueueConfig(groups=1, group_size=1))
    r.handle(ev.PrepareRequested(info=info(owners=("a",))))
    assert r.queue.capacity == 2
    out = r.handle(arrived(1, "a", 1))
    assert of(out, cmd.Decode)  # one slot for later payloads
    out = r.handle(arrived(1, "a", 2))
    assert not of(out, cmd.Decode)  # the last slot is reserved for payload 0
    [pause] = of(out, cmd.PauseIngest)
    assert pause.want == key(1, "a", 0) and not r.reading
    out = r.handle(arrived(1, "a", 0))
    assert [c.key for c in of(out, cmd.Decode)] == [key(1, "a", 0)]  # the reserved slot


def test_flush_checks_arrival_against_the_declared_sent_lists() -> None:
    r = prepared()
    gated_and_open(r)
    r.handle(arrived(1, "a", 0, final=True))
    out = r.handle(ev.FlushRequested(attempt=1, expected=(("a", 2), ("b", 1))))
    [failure] = notified(out, ev.AttemptFailed)
    assert failure.check == "arrival"


def test_stop_and_wait_answers_only_after_pending_writes_finish() -> None:
    r = prepared(info(owners=("a",)))
    r.handle(arrived(1, "a", 0, final=True))
    gated_and_open(r)
    [apply] = of(r.handle(ev.PayloadDecoded(key=key(1, "a", 0))), cmd.Apply)
    r.handle(ev.MarkObsoleteRequested(attempt=1, epoch=1))
    assert not notified(r.handle(ev.StopAndWaitRequested(attempt=1, epoch=1)), ev.Stopped)
    [stopped] = notified(r.handle(ev.PayloadsApplied(attempt=1, keys=apply.keys)), ev.Stopped)
    assert stopped.dirty and r.phase is ReceiverPhase.STOPPED
    assert of(r.handle(ev.CleanupRequested(attempt=1)), cmd.Release)
    assert notified(r.handle(ev.StopAndWaitRequested(attempt=9, epoch=1)), ev.Stopped)


def test_partially_written_storage_refuses_mixed_mode_and_takes_overwrite() -> None:
    r = prepared(info(owners=("a",)))
    r.handle(arrived(1, "a", 0, final=True))
    gated_and_open(r)
    r.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    r.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),), failure="loader"))
    for e in (ev.StopAndWaitRequested(attempt=1, epoch=1), ev.CleanupRequested(attempt=1)):
        r.handle(e)
    assert r.dirty and r.phase is ReceiverPhase.CLEANED
    [failure] = notified(
        r.handle(ev.PrepareRequested(info=info(2, owners=("a",)))), ev.AttemptFailed
    )
    assert failure.check == "mode"
    out = r.handle(ev.PrepareRequested(info=info(3, mode=Mode.OVERWRITE, owners=("a",))))
    assert notified(out, ev.PrepareAccepted)


def test_gate_reopens_only_at_a_record_the_receiver_holds_and_after_kv_invalidation() -> None:
    r = prepared(info(owners=("a",)))
    r.handle(arrived(1, "a", 0, final=True))
    gated_and_open(r)
    r.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    r.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),)))
    r.handle(ev.FlushRequested(attempt=1, expected=(("a", 1),)))
    r.handle(ev.Synchronized(attempt=1))
    r.handle(ev.CleanupRequested(attempt=1))
    wrong = CommitRecord(version=1, candidate="someone-else")
    refused = r.handle(ev.ReopenGateRequested(attempt=1, epoch=1, record=wrong))
    assert notified(refused, ev.AttemptFailed) and not r.gate_open
    assert r.handle(ev.ReopenGateRequested(attempt=1, epoch=0, record=info().target)) == []
    out = r.handle(ev.ReopenGateRequested(attempt=1, epoch=1, record=info().target))
    assert [type(c) for c in out] == [cmd.InvalidateKvCache, cmd.OpenGate]
    assert r.gate_open and r.held == info().target and r.phase is ReceiverPhase.READY


def test_a_restarted_receiver_joins_only_after_a_dense_refit_of_the_committed_record() -> None:
    r = ReceiverCore("r", held=None)
    assert r.phase is ReceiverPhase.JOINING
    assert not r.gate_open and r.held is None
    [failure] = notified(r.handle(ev.PrepareRequested(info=info())), ev.AttemptFailed)
    assert failure.check == "joining"
    [ready] = notified(r.handle(ev.DenseRefitDone(record=K0)), ev.ReceiverReady)
    assert ready.record == K0 and r.held == K0 and not r.gate_open
    assert notified(r.handle(ev.PrepareRequested(info=info())), ev.PrepareAccepted)


def test_late_prepare_of_a_stopped_attempt_and_replaced_coordinator_are_refused() -> None:
    r = ReceiverCore("r", held=K0)
    assert notified(r.handle(ev.StopAndWaitRequested(attempt=5, epoch=2)), ev.Stopped)
    [stale] = notified(r.handle(ev.PrepareRequested(info=info(5, epoch=2))), ev.AttemptFailed)
    assert stale.check == "stale"
    [old] = notified(r.handle(ev.PrepareRequested(info=info(6, epoch=1))), ev.AttemptFailed)
    assert old.check == "epoch"


def test_engine_contract_violation_raises_local_protocol_error() -> None:
    r = ReceiverCore("r", held=K0)
    with pytest.raises(LocalProtocolError):
        r.handle(ev.DenseRefitDone(record=K0))  # a serving receiver is never dense-refitted
    assert r.phase is ReceiverPhase.READY


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
    r.handle(ev.PrepareRequested(info=info(owners=names, sync=sync)))
    arrivals = [arrived(1, o, p, final=p == counts[o] - 1) for o in names for p in range(counts[o])]
    arrivals = data.draw(st.permutations(arrivals))
    pending: list[ev.ReceiverEvent] = []
    held: set[PayloadKey] = set()
    applied: list[PayloadKey] = []

    def run(out: Sequence[object]) -> None:
        for c in out:
            if isinstance(c, cmd.Decode):
                held.add(c.key)
                assert len(held) <= queue.capacity
                pending.append(ev.PayloadDecoded(key=c.key))
            elif isinstance(c, cmd.Apply):
                assert len(c.keys) <= queue.group_size
                applied.extend(c.keys)
                pending.append(ev.PayloadsApplied(attempt=1, keys=c.keys))
            elif isinstance(c, cmd.CloseGate):
                pending.append(ev.RequestsDrained(attempt=1))
            elif isinstance(c, cmd.Synchronize):
                pending.append(ev.Synchronized(attempt=1))

    def complete_some() -> None:
        while pending:
            if not data.draw(st.booleans()):
                return
            e = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            if isinstance(e, ev.PayloadsApplied):
                held.difference_update(e.keys)
            run(r.handle(e))

    if sync:
        run(r.handle(ev.WaitForRequestsRequested(attempt=1, epoch=1)))
        run(r.handle(ev.OpenApplyRequested(attempt=1, epoch=1)))
    for a in arrivals:
        run(r.handle(a))
        complete_some()
    if not sync:
        run(r.handle(ev.WaitForRequestsRequested(attempt=1, epoch=1)))
        run(r.handle(ev.OpenApplyRequested(attempt=1, epoch=1)))
    run(r.handle(ev.FlushRequested(attempt=1, expected=tuple(counts.items()))))
    while pending:
        e = pending.pop(0)
        if isinstance(e, ev.PayloadsApplied):
            held.difference_update(e.keys)
        run(r.handle(e))
    declared = sorted(
        (key(1, o, p) for o in names for p in range(counts[o])),
        key=lambda k: (k.payload_id, names.index(k.owner)),
    )
    assert applied == declared
    assert r.phase is ReceiverPhase.ACKED and r.applied == tuple(counts.items())


def test_paused_ingestion_follows_the_next_payload_in_declared_order():
    """With the queue full of later payloads, ingestion must let through exactly the payload
    the declared order needs next -- and re-announce it each time the cursor moves on."""
    r = ReceiverCore("r", held=K0, queue=QueueConfig(groups=1, group_size=1))  # capacity 2
    r.handle(ev.PrepareRequested(info=info(owners=("a",))))
    r.handle(ev.WaitForRequestsRequested(attempt=1, epoch=1))
    r.handle(ev.RequestsDrained(attempt=1))
    r.handle(ev.OpenApplyRequested(attempt=1, epoch=1))
    r.handle(arrived(1, "a", 3, final=True))
    out = r.handle(arrived(1, "a", 2))
    assert of(out, cmd.PauseIngest) == [cmd.PauseIngest(attempt=1, want=key(1, "a", 0))]
    out = r.handle(arrived(1, "a", 0))
    assert of(out, cmd.Decode) == [cmd.Decode(key=key(1, "a", 0))]
    out = r.handle(ev.PayloadDecoded(key=key(1, "a", 0)))
    assert of(out, cmd.Apply) == [cmd.Apply(attempt=1, keys=(key(1, "a", 0),))]
    out = r.handle(ev.PayloadsApplied(attempt=1, keys=(key(1, "a", 0),)))
    # the cursor moved to a/1, which has not arrived: ingestion must now wait for it
    assert of(out, cmd.PauseIngest) == [cmd.PauseIngest(attempt=1, want=key(1, "a", 1))]
    out = r.handle(arrived(1, "a", 1))
    assert of(out, cmd.Decode) == [cmd.Decode(key=key(1, "a", 1))]
