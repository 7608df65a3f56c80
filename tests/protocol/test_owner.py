"""OwnerCore: pipelined streaming, sent lists, stop path and the in-place baseline update."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dcr.errors import RemoteProtocolError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import OwnerPhase
from dcr.protocol.owner import OwnerCore
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode

K0 = CommitRecord(version=0, candidate="g0")


def info(tau: int = 1, *, epoch: int = 1, mode: Mode = Mode.MIXED) -> AttemptInfo:
    return AttemptInfo(
        attempt=tau,
        candidate=f"g{tau}",
        base=K0,
        mode=mode,
        sync=True,
        coordinator=epoch,
        owners=("o",),
        receivers=frozenset({"r"}),
    )


def of(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c for c in commands if isinstance(c, kind)]


def notified(commands: Sequence[object], kind: type) -> list:  # type: ignore[type-arg]
    return [c.message for c in of(commands, cmd.Notify) if isinstance(c.message, kind)]


def streaming(tau: int = 1, mode: Mode = Mode.MIXED) -> tuple[OwnerCore, list[object]]:
    """An owner that accepted ``tau`` and was started; the commands of both steps."""
    o = OwnerCore("o", baseline=K0)
    prepared = o.handle(msg.Prepare(info=info(tau, mode=mode)))
    assert notified(prepared, msg.PrepareAccepted)
    return o, [*prepared, *o.handle(msg.StartStreaming(attempt=tau))]


def test_owner_builds_the_next_bucket_while_one_is_sent_and_declares_its_sent_list() -> None:
    o, started = streaming(mode=Mode.OVERWRITE)
    out: Sequence[object] = started
    [build] = of(out, cmd.BuildBucket)
    assert (build.payload_id, build.mode) == (0, Mode.OVERWRITE)
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=0, final=False))
    assert [c.payload_id for c in of(out, cmd.SendPayload)] == [0]
    assert [c.payload_id for c in of(out, cmd.BuildBucket)] == [1]  # pipelined
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=1, final=True))
    assert not of(out, cmd.SendPayload)  # one send in flight at a time
    out = o.handle(ev.PayloadSent(attempt=1, payload_id=0))
    [send] = of(out, cmd.SendPayload)
    assert send.payload_id == 1 and send.final and not of(out, cmd.BuildBucket)
    [done] = notified(o.handle(ev.PayloadSent(attempt=1, payload_id=1)), msg.SendsDone)
    assert done.payload_count == 2 and o.sent == {0, 1}
    o.handle(msg.Flush(attempt=1, expected=()))
    assert o.phase is OwnerPhase.SENT


def test_construction_overlaps_admission_but_nothing_is_sent_before_start_streaming() -> None:
    o = OwnerCore("o", baseline=K0, sends_in_flight=2)
    out = o.handle(msg.Prepare(info=info()))
    assert notified(out, msg.PrepareAccepted)
    assert [c.payload_id for c in of(out, cmd.BuildBucket)] == [0]  # before admission
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=0, final=False))
    assert not of(out, cmd.SendPayload) and o.phase is OwnerPhase.PREPARED
    assert [c.payload_id for c in of(out, cmd.BuildBucket)] == [1]  # bounded like streaming
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=1, final=False))
    assert [c.payload_id for c in of(out, cmd.BuildBucket)] == [2]
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=2, final=True))
    assert not of(out, cmd.SendPayload) and not of(out, cmd.BuildBucket)  # pipeline full
    out = o.handle(msg.StartStreaming(attempt=1))
    assert [c.payload_id for c in of(out, cmd.SendPayload)] == [0, 1]  # sends_in_flight
    assert o.phase is OwnerPhase.SENDING and not of(out, cmd.BuildBucket)
    out = o.handle(ev.PayloadSent(attempt=1, payload_id=0))
    [send] = of(out, cmd.SendPayload)
    assert (send.payload_id, send.final) == (2, True)


def test_an_attempt_stopped_during_admission_waits_for_its_build_and_sends_nothing() -> None:
    o = OwnerCore("o", baseline=K0)
    assert of(o.handle(msg.Prepare(info=info())), cmd.BuildBucket)
    out = o.handle(msg.StopAndWait(attempt=1, epoch=1))
    assert of(out, cmd.StopStreaming) and not notified(out, msg.Stopped)
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=0, final=False))
    assert notified(out, msg.Stopped) and not of(out, cmd.SendPayload)
    assert not of(out, cmd.BuildBucket)
    assert not of(o.handle(msg.StartStreaming(attempt=1)), cmd.SendPayload)  # a late start
    assert of(o.handle(msg.Cleanup(attempt=1)), cmd.Release)
    assert o.phase is OwnerPhase.IDLE and o.baseline == K0


def test_an_encode_failure_fails_the_attempt_and_stops_streaming() -> None:
    o, _ = streaming()
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=0, final=False, failure="zstd"))
    assert of(out, cmd.StopStreaming)
    [failed] = notified(out, msg.AttemptFailed)
    assert failed.check == "encode"


def test_stop_and_wait_waits_for_the_build_in_flight_then_cleanup_releases() -> None:
    o, _ = streaming()
    o.handle(msg.MarkObsolete(attempt=1, epoch=1))
    assert not notified(o.handle(msg.StopAndWait(attempt=1, epoch=1)), msg.Stopped)
    out = o.handle(ev.BucketBuilt(attempt=1, payload_id=0, final=True))
    assert notified(out, msg.Stopped) and not of(out, cmd.SendPayload)
    assert of(o.handle(msg.Cleanup(attempt=1)), cmd.Release)
    assert o.phase is OwnerPhase.IDLE and o.baseline == K0  # B^v unchanged


def _sent_everything(o: OwnerCore, tau: int = 1) -> None:
    o.handle(ev.BucketBuilt(attempt=tau, payload_id=0, final=True))
    o.handle(ev.PayloadSent(attempt=tau, payload_id=0))
    o.handle(msg.Flush(attempt=tau, expected=()))


def test_baseline_is_kept_until_the_record_names_our_candidate_then_updated_once_more_is_safe() -> (
    None
):
    o, _ = streaming()
    _sent_everything(o)
    # Nothing committed yet: nothing is written; the baseline it holds is reported as is.
    out = o.handle(ev.CommitRecordRead(record=K0))
    assert not of(out, cmd.UpdateBaseline) and o.baseline == K0
    assert [r.record for r in notified(out, msg.BaselineUpdated)] == [K0]
    target = info().target
    [update] = of(o.handle(ev.CommitRecordRead(record=target)), cmd.UpdateBaseline)
    assert update.record == target and o.baseline == K0  # updated only once written
    [report] = notified(o.handle(ev.BaselineWritten(record=target)), msg.BaselineUpdated)
    assert report.record == target and o.baseline == target
    # After failover the new coordinator asks again: the update repeats (absolute values).
    assert of(o.handle(ev.CommitRecordRead(record=target)), cmd.UpdateBaseline)
    assert notified(o.handle(ev.BaselineWritten(record=target)), msg.BaselineUpdated)


def test_an_owner_restarted_at_the_committed_version_reports_its_baseline() -> None:
    """A trainer restarted after the commit holds the committed version already: the
    coordinator finishing that transition gets its report without any write."""
    target = info().target
    o = OwnerCore("o", baseline=target)
    out = o.handle(msg.ReadRecord())
    assert out == [cmd.FetchRecord()]
    out = o.handle(ev.CommitRecordRead(record=target))
    assert [r.record for r in notified(out, msg.BaselineUpdated)] == [target]
    assert not of(out, cmd.UpdateBaseline)


def test_a_record_for_a_candidate_the_owner_does_not_hold_needs_the_operator() -> None:
    o, _ = streaming()
    with pytest.raises(RemoteProtocolError):
        o.handle(ev.CommitRecordRead(record=CommitRecord(version=1, candidate="unknown")))


def test_duplicate_prepare_is_answered_again_and_stale_ones_are_refused() -> None:
    o = OwnerCore("o", baseline=K0)
    o.handle(msg.Prepare(info=info(4)))
    assert notified(o.handle(msg.Prepare(info=info(4))), msg.PrepareAccepted)
    o.handle(msg.StopAndWait(attempt=4, epoch=2))
    o.handle(msg.Cleanup(attempt=4))
    [stale] = notified(o.handle(msg.Prepare(info=info(4, epoch=2))), msg.AttemptFailed)
    assert stale.check == "stale"
    [replaced] = notified(o.handle(msg.Prepare(info=info(5, epoch=1))), msg.AttemptFailed)
    assert replaced.check == "epoch"
    assert notified(o.handle(msg.Prepare(info=info(6, epoch=2))), msg.PrepareAccepted)


def test_a_metadata_rejection_is_a_reject_not_a_failure() -> None:
    o = OwnerCore("o", baseline=K0)
    [reject] = notified(
        o.handle(ev.PrepareChecked(info=info(), rejection="schema")), msg.PrepareRejected
    )
    assert reject.check == "schema" and o.phase is OwnerPhase.IDLE


def test_a_dense_job_reports_its_sent_list_or_its_failure() -> None:
    o = OwnerCore("o", baseline=K0)
    call = msg.DenseRefit(job=9, record=K0, owners=("o",), receivers=frozenset({"r"}))
    [send] = of(o.handle(call), cmd.SendDense)
    assert send.job == 9 and send.to == frozenset({"r"})
    assert o.handle(call) == []  # a repeated call while the job runs
    [done] = notified(o.handle(ev.DenseSent(job=9, payloads=3)), msg.SendsDone)
    assert (done.attempt, done.owner, done.payload_count) == (9, "o", 3)
    o.handle(msg.DenseRefit(job=10, record=K0, owners=("o",), receivers=frozenset({"r"})))
    out = o.handle(ev.DenseSent(job=10, payloads=1, failure="relay root restarted"))
    [failed] = notified(out, msg.AttemptFailed)
    assert failed.attempt == 10 and failed.check == "dense" and not notified(out, msg.SendsDone)


def test_a_prepare_waits_for_the_candidate_and_a_baseline_update_consumes_it() -> None:
    """A trainer restarted mid-transition is still computing its step: the prepare is held
    (no failure, no acceptance) until the candidate is staged; the latest held one wins.  The
    committed candidate is consumed: the next prepare waits for the next stage."""
    o = OwnerCore("o", baseline=K0, staged=False)
    assert not o.staged
    assert o.handle(msg.Prepare(info=info(1))) == [] and o.holding
    assert o.handle(msg.Prepare(info=info(2))) == [] and o.phase is OwnerPhase.IDLE
    assert o.handle(ev.CandidateStaged(staged=False)) == [] and o.holding
    out = o.handle(ev.CandidateStaged(staged=True))
    [accepted] = notified(out, msg.PrepareAccepted)
    assert accepted.attempt == 2 and not o.holding and o.staged
    o.handle(msg.StartStreaming(attempt=2))
    o.handle(ev.BucketBuilt(attempt=2, payload_id=0, final=True))
    o.handle(ev.PayloadSent(attempt=2, payload_id=0))
    target = info(2).target
    o.handle(ev.CommitRecordRead(record=target))
    o.handle(ev.BaselineWritten(record=target))
    assert o.baseline == target and not o.staged
    follow = AttemptInfo(
        attempt=3, candidate="g3", base=target, mode=Mode.MIXED, sync=True, coordinator=1,
        owners=("o",), receivers=frozenset({"r"}),
    )  # fmt: skip
    assert o.handle(msg.Prepare(info=follow)) == [] and o.holding
    assert notified(o.handle(ev.CandidateStaged()), msg.PrepareAccepted)


def test_a_repeated_prepare_of_the_running_attempt_is_answered_even_with_nothing_staged() -> None:
    o, _ = streaming()
    o.handle(ev.CandidateStaged(staged=False))
    [again] = notified(o.handle(msg.Prepare(info=info(1))), msg.PrepareAccepted)
    assert again.attempt == 1 and not o.holding
