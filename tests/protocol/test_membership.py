"""The membership core, one rule per test: who a transition requires, when it starts, dense
refits of joining receivers, restarts, takeovers and settling (dcr.protocol.membership).

Time only arrives with ``Tick(now=...)``; every test feeds explicit times.
"""

from __future__ import annotations

from collections.abc import Iterable

from dcr.protocol import messages as msg
from dcr.protocol.membership import (
    CheckArrival,
    DenseAsked,
    MembershipCommand,
    MembershipConfig,
    MembershipCore,
    ReleaseJob,
    ReopenGate,
    Retire,
    RunTransition,
    Say,
    StartDense,
    Tick,
    TransitionDone,
)
from dcr.protocol.types import AttemptInfo, CommitRecord, EpochIds, Mode

K0 = CommitRecord(version=0, candidate="g0")
K1 = CommitRecord(version=1, candidate="g1")
K2 = CommitRecord(version=2, candidate="g2")
OWNERS = ("o0", "o1")
RECEIVERS = ("r0", "r1")


def core(epoch: int = 1, **config: object) -> MembershipCore:
    return MembershipCore(
        MembershipConfig(owners=OWNERS, receivers=RECEIVERS, **config),  # type: ignore[arg-type]
        epoch=epoch,
    )


def status(
    name: str, record: CommitRecord | None, *, inc: str = "i0", candidate: bool = False
) -> msg.EndpointStatus:
    role = "owner" if name.startswith("o") else "receiver"
    return msg.EndpointStatus(
        endpoint=name, role=role, incarnation=inc, record=record, candidate=candidate
    )


def report(
    c: MembershipCore,
    *,
    owners: CommitRecord | None = K0,
    staged: bool = True,
    receivers: dict[str, CommitRecord | None] | None = None,
) -> list[MembershipCommand]:
    """Every owner reports ``owners`` (with a staged candidate), each receiver its record."""
    out: list[MembershipCommand] = []
    if owners is not None:
        for o in OWNERS:
            out += c.handle(status(o, owners, candidate=staged))
    for r, record in (receivers if receivers is not None else dict.fromkeys(RECEIVERS, K0)).items():
        out += c.handle(status(r, record))
    return out


def of(kind: type, out: Iterable[MembershipCommand]) -> list:  # type: ignore[type-arg]
    return [c for c in out if isinstance(c, kind)]


def run_of(out: list[MembershipCommand]) -> RunTransition:
    [run] = of(RunTransition, out)
    return run


def said(kind: str, out: list[MembershipCommand]) -> list[dict[str, object]]:
    return [c.fields for c in of(Say, out) if c.kind == kind]


def attempt(base: CommitRecord, *, coordinator: int, tau: int = 5) -> AttemptInfo:
    return AttemptInfo(
        attempt=tau, candidate=f"g{coordinator}.{tau}", base=base, mode=Mode.MIXED, sync=True,
        coordinator=coordinator, owners=OWNERS, receivers=frozenset(RECEIVERS),
    )  # fmt: skip


def settled_after_first(c: MembershipCore) -> MembershipCore:
    """Run the first transition K0 -> K1 (fingerprinting both receivers); both report K1 and
    the owners their baseline K1, with nothing staged yet."""
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(TransitionDone(record=K1, epoch=c.epoch, disproved=frozenset()))
    report(c, owners=K1, staged=False, receivers=dict.fromkeys(RECEIVERS, K1))
    assert of(RunTransition, c.handle(Tick(now=0.5, record=K1))) == []  # settled, not staged
    return c


# -- who is required, and whether the first prepare fingerprints them ---------------------


def test_a_receiver_seen_for_the_first_time_is_fingerprinted_at_its_first_transition() -> None:
    c = core()
    report(c)
    assert c.unverified == {"r0", "r1"}
    run = run_of(c.handle(Tick(now=0, record=K0)))
    assert run.fingerprint and run.members == ("r0", "r1") and run.base == K0
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))
    assert c.unverified == set()
    report(c, owners=K1, receivers=dict.fromkeys(RECEIVERS, K1))
    second = run_of(c.handle(Tick(now=1, record=K1)))
    assert not second.fingerprint and second.members == ("r0", "r1")


def test_without_fingerprint_on_join_no_transition_fingerprints() -> None:
    c = core(fingerprint_on_join=False)
    report(c)
    assert not run_of(c.handle(Tick(now=0, record=K0))).fingerprint


def test_members_are_the_receivers_reporting_the_base_record_exactly() -> None:
    c = core()
    report(c, receivers={"r0": K0, "r1": K1})  # r1 claims a version the record never had
    run = run_of(c.handle(Tick(now=0, record=K0)))
    assert run.members == ("r0",)
    assert run.not_waiting == ("r1",)
    assert c.members(K0) == ("r0",) and c.joining(K0) == {"r1"}


def test_a_receiver_that_never_reported_is_no_member_and_gets_no_dense_job() -> None:
    c = core()
    report(c, receivers={"r0": K0})
    out = c.handle(Tick(now=0, record=K0))
    assert run_of(out).members == ("r0",) and run_of(out).not_waiting == ("r1",)
    assert of(StartDense, out) == []  # nothing to restore before it says hello


# -- when a transition starts ---------------------------------------------------------------


def test_nothing_starts_until_every_owner_staged_on_the_committed_record() -> None:
    c = core()
    report(c, staged=False)
    assert of(RunTransition, c.handle(Tick(now=0, record=K0))) == []
    c.handle(status("o0", K0, candidate=True))
    assert of(RunTransition, c.handle(Tick(now=1, record=K0))) == []
    c.handle(status("o1", K1, candidate=True))  # staged, but on another record
    assert of(RunTransition, c.handle(Tick(now=2, record=K0))) == []
    c.handle(status("o1", K0, candidate=True))
    assert run_of(c.handle(Tick(now=3, record=K0))).base == K0


def test_every_receiver_holding_the_record_starts_at_once_despite_a_join_wait() -> None:
    c = core(join_wait_s=60)
    report(c)
    run = run_of(c.handle(Tick(now=0, record=K0)))
    assert run.members == ("r0", "r1") and run.not_waiting == ()


def test_joiners_are_waited_for_join_wait_s_after_the_owners_staged_then_left_out() -> None:
    c = core(join_wait_s=10)
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    assert of(RunTransition, c.handle(Tick(now=0, record=K0))) == []
    report(c, receivers={"r0": K0, "r1": None})  # the owners staged: the wait starts now
    assert of(RunTransition, c.handle(Tick(now=5, record=K0))) == []
    assert of(RunTransition, c.handle(Tick(now=14.9, record=K0))) == []
    run = run_of(c.handle(Tick(now=15, record=K0)))
    assert run.members == ("r0",) and run.not_waiting == ("r1",)


def test_a_joiner_restored_within_the_wait_is_a_member() -> None:
    c = core(join_wait_s=10)
    report(c, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=0, record=K0)))
    c.handle(msg.ReceiverReady(receiver="r1", record=K0))
    run = run_of(c.handle(Tick(now=3, record=K0)))
    assert run.members == ("r0", "r1") and run.not_waiting == ()
    assert run.fingerprint and "r1" in c.unverified
    assert job.receiver == "r1"


def test_without_a_join_wait_joiners_are_left_out_at_once() -> None:
    c = core()
    report(c, receivers={"r0": K0, "r1": None})
    out = c.handle(Tick(now=0, record=K0))
    assert run_of(out).not_waiting == ("r1",)
    assert [s.receiver for s in of(StartDense, out)] == ["r1"]


def test_only_one_transition_runs_at_a_time() -> None:
    c = core()
    report(c)
    run = run_of(c.handle(Tick(now=0, record=K0)))
    assert c.running == run
    assert of(RunTransition, c.handle(Tick(now=1, record=K0))) == []


# -- dense refit of joining, restarted and behind receivers ---------------------------------


def test_a_receiver_with_no_record_or_behind_gets_a_dense_job_of_the_committed_record() -> None:
    c = core()
    report(c, staged=False, receivers={"r0": None, "r1": K0})
    out = c.handle(Tick(now=0, record=K1))  # r1 is a version behind
    starts = of(StartDense, out)
    assert [(s.receiver, s.record) for s in starts] == [("r0", K1), ("r1", K1)]
    assert c.jobs() == {"r0": starts[0].job, "r1": starts[1].job}
    assert [f["receiver"] for f in said("dense", out)] == ["r0", "r1"]
    assert c.job_of(starts[0].job) == "r0"
    # A job in flight is not started again before it fails or lapses.
    assert of(StartDense, c.handle(Tick(now=1, record=K1))) == []


def test_a_failed_job_is_sent_again_after_retry_s_under_a_fresh_id() -> None:
    c = core(retry_s=2.0, dense_timeout_s=600)
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=10, record=K0)))
    out = c.handle(msg.AttemptFailed(attempt=job.job, endpoint="o1", check="version"))
    assert said("dense-failed", out) == [
        {"receiver": "r1", "job": job.job, "endpoint": "o1", "check": "version", "message": ""}
    ]
    assert of(StartDense, c.handle(Tick(now=11.9, record=K0))) == []
    out = c.handle(Tick(now=12, record=K0))
    [again] = of(StartDense, out)
    assert of(ReleaseJob, out) == [ReleaseJob(job=job.job)]
    assert again.receiver == "r1" and again.job > job.job
    assert c.job_of(job.job) is None and c.job_of(again.job) == "r1"


def test_a_failure_of_an_unknown_job_changes_nothing() -> None:
    c = core(retry_s=2.0)
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=0, record=K0)))
    assert c.handle(msg.AttemptFailed(attempt=job.job + 7, endpoint="o0", check="x")) == []
    assert of(StartDense, c.handle(Tick(now=3, record=K0))) == []


def test_a_job_not_done_within_dense_timeout_s_is_sent_again() -> None:
    c = core(dense_timeout_s=100)
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=0, record=K0)))
    assert of(StartDense, c.handle(Tick(now=99, record=K0))) == []
    out = c.handle(Tick(now=100, record=K0))
    [again] = of(StartDense, out)
    assert of(ReleaseJob, out) == [ReleaseJob(job=job.job)] and again.job > job.job


def test_the_job_is_released_once_the_receiver_reports_the_record() -> None:
    c = core()
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=0, record=K0)))
    c.handle(status("r1", K0))
    out = c.handle(Tick(now=1, record=K0))
    assert out == [ReleaseJob(job=job.job)]
    assert c.jobs() == {}


def test_a_restored_receiver_reopens_its_gate_at_once_and_is_verified_again() -> None:
    c = settled_after_first(core())
    assert c.unverified == set()
    c.handle(status("r1", None, inc="i1"))  # restarted
    [job] = of(StartDense, c.handle(Tick(now=1, record=K1)))
    out = c.handle(msg.ReceiverReady(receiver="r1", record=K1))
    assert out[0] == ReleaseJob(job=job.job)
    assert said("restored", out) == [{"receiver": "r1", "version": 1}]
    assert out[-1] == ReopenGate(job=job.job, receiver="r1", record=K1)
    assert "r1" in c.unverified and c.jobs() == {}
    # Its status counts as K1 at once: no second job, and it is a member (fingerprinted).
    c.handle(status("o0", K1, candidate=True))
    c.handle(status("o1", K1, candidate=True))
    run = run_of(c.handle(Tick(now=2, record=K1)))
    assert run.members == ("r0", "r1") and run.fingerprint


def test_a_ready_report_of_another_record_does_not_reopen_the_gate() -> None:
    c = core()
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    c.handle(Tick(now=0, record=K1))
    out = c.handle(msg.ReceiverReady(receiver="r1", record=K0))
    assert of(ReopenGate, out) == [] and of(ReleaseJob, out) == []
    assert "r1" in c.jobs()


def test_arrival_is_checked_once_every_owner_said_its_sends_are_done() -> None:
    c = core()
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [job] = of(StartDense, c.handle(Tick(now=0, record=K0)))
    assert c.handle(msg.SendsDone(attempt=job.job, owner="o1", payload_count=2)) == []
    out = c.handle(msg.SendsDone(attempt=job.job, owner="o0", payload_count=3))
    assert out == [CheckArrival(job=job.job, receiver="r1", expected=(("o1", 2), ("o0", 3)))]
    # Sends of another attempt or job are not the membership's.
    assert c.handle(msg.SendsDone(attempt=job.job + 1, owner="o0", payload_count=3)) == []


def test_a_running_transitions_members_are_refitted_only_when_it_asks() -> None:
    c = core()
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(status("r0", None))  # disproved: it no longer claims a record
    assert of(StartDense, c.handle(Tick(now=1, record=K0))) == []
    out = c.handle(DenseAsked(record=K0, receivers=frozenset({"r0"})))
    [job] = of(StartDense, out)
    assert (job.receiver, job.record) == ("r0", K0)
    # A job the run asked for is sent again when it failed.
    c.handle(msg.AttemptFailed(attempt=job.job, endpoint="o0", check="version"))
    [again] = of(StartDense, c.handle(Tick(now=5, record=K0)))
    assert again.receiver == "r0" and again.job > job.job


# -- restarts -------------------------------------------------------------------------------


def test_a_restart_during_a_run_retires_the_old_process_and_releases_its_job() -> None:
    c = core()
    report(c, receivers={"r0": K0, "r1": None})
    out = c.handle(Tick(now=0, record=K0))
    [job] = of(StartDense, out)
    assert run_of(out).members == ("r0",) and c.running is not None
    out = c.handle(status("r1", None, inc="i1"))  # restarted while restoring
    assert out == [
        ReleaseJob(job=job.job),
        Say(kind="restarted", fields={"endpoint": "r1"}),
        Retire(endpoint="r1"),
    ]
    assert c.restarted() == ("r1",) and "r1" in c.unverified and c.jobs() == {}
    # Not engaged in the run: the new process is restored under a fresh job.
    [again] = of(StartDense, c.handle(Tick(now=1, record=K0)))
    assert again.receiver == "r1" and again.job > job.job


def test_a_restart_between_runs_is_not_retired() -> None:
    c = settled_after_first(core())
    out = c.handle(status("r0", K1, inc="i1"))  # a new process claiming K1
    assert out == [Say(kind="restarted", fields={"endpoint": "r0"})]
    assert c.unverified == {"r0"} and c.restarted() == ("r0",)
    c.handle(status("o0", K1, candidate=True))
    c.handle(status("o1", K1, candidate=True))
    run = run_of(c.handle(Tick(now=1, record=K1)))
    assert run.fingerprint and run.members == ("r0", "r1")
    assert c.restarted() == ()  # cleared when the run starts


def test_a_restarted_member_during_a_run_is_retired_and_refitted_after_it() -> None:
    c = core(settle_s=100)
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    out = c.handle(status("r1", None, inc="i1"))
    assert of(Retire, out) == [Retire(endpoint="r1")]
    assert of(StartDense, c.handle(Tick(now=1, record=K0))) == []  # still engaged
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))
    c.handle(status("r0", K1))
    # r0 reports K1 and r1 restarted: settled; r1 is restored to K1.
    out = c.handle(Tick(now=2, record=K1))
    assert [(s.receiver, s.record) for s in of(StartDense, out)] == [("r1", K1)]


def test_a_late_ready_report_of_a_restarted_receivers_old_process_is_not_the_new_ones() -> None:
    c = core()
    report(c, staged=False, receivers={"r0": K0, "r1": None})
    [first] = of(StartDense, c.handle(Tick(now=0, record=K0)))  # restores r1
    c.handle(status("r1", None, inc="i1"))  # r1 restarts; the first job is released
    [job] = of(StartDense, c.handle(Tick(now=1, record=K0)))  # a job for the new process
    # The old process restored K0 by the first job just before it died; its report arrives.
    assert c.handle(msg.ReceiverReady(receiver="r1", record=K0, job=first.job)) == []
    # The new process holds nothing: it is not a member, and its job is still in flight.
    assert c.members(K0) == ("r0",) and c.jobs() == {"r1": job.job}
    # Its own job's report counts.
    out = c.handle(msg.ReceiverReady(receiver="r1", record=K0, job=job.job))
    assert of(ReopenGate, out) and c.members(K0) == ("r0", "r1") and c.jobs() == {}


def test_a_restart_with_the_same_incarnation_is_a_report_not_a_restart() -> None:
    c = settled_after_first(core())
    assert c.handle(status("r0", K1)) == []
    assert c.unverified == set() and c.restarted() == ()


# -- takeover of a replaced coordinator's unfinished attempt -------------------------------


def test_an_uncommitted_attempt_whose_owners_still_hold_candidates_is_taken_over() -> None:
    c = core(epoch=2)
    info = attempt(K0, coordinator=1)
    report(c)
    run = run_of(c.handle(Tick(now=0, record=K0, attempt=info)))
    assert run.take_over == info and run.base == K0 and run.not_waiting == ()


def test_a_committed_attempt_with_an_owner_still_at_the_base_is_taken_over() -> None:
    c = core(epoch=2)
    info = attempt(K0, coordinator=1)
    target = info.target
    c.handle(status("o0", target))
    c.handle(status("o1", K0, candidate=True))  # has not moved its baseline yet
    report(c, owners=None, receivers={"r0": target, "r1": K0})
    run = run_of(c.handle(Tick(now=0, record=target, attempt=info)))
    assert run.take_over == info and run.base == K0
    assert run.members == ("r1",)  # (the takeover binds the old attempt's receivers)


def test_no_takeover_before_every_owner_reported() -> None:
    c = core(epoch=2)
    info = attempt(K0, coordinator=1)
    c.handle(status("o0", K0, candidate=True))
    report(c, owners=None)
    assert of(RunTransition, c.handle(Tick(now=0, record=K0, attempt=info))) == []
    c.handle(status("o1", K0, candidate=True))
    assert run_of(c.handle(Tick(now=1, record=K0, attempt=info))).take_over == info


def test_a_finished_or_own_attempt_is_not_taken_over() -> None:
    info = attempt(K0, coordinator=1)
    # Committed and every owner moved: finished; the next transition starts afresh.
    c = core(epoch=2)
    report(c, owners=info.target, receivers=dict.fromkeys(RECEIVERS, info.target))
    run = run_of(c.handle(Tick(now=0, record=info.target, attempt=info)))
    assert run.take_over is None and run.base == info.target
    # Not committed and an owner dropped its candidate: nothing to resume.
    c = core(epoch=2)
    report(c)
    c.handle(status("o1", K0, candidate=False))
    assert of(RunTransition, c.handle(Tick(now=0, record=K0, attempt=info))) == []
    # Its own epoch's attempt is not a replaced coordinator's.
    c = core(epoch=1)
    report(c)
    assert run_of(c.handle(Tick(now=0, record=K0, attempt=info))).take_over is None


# -- settling after a transition ------------------------------------------------------------


def test_the_next_transition_waits_for_the_members_to_report_the_committed_record() -> None:
    c = core(settle_s=50)
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))
    report(c, owners=K1, receivers={"r0": K1})  # r1 has not reported K1 yet
    out = c.handle(Tick(now=1, record=K1))
    assert of(RunTransition, out) == [] and of(StartDense, out) == []  # r1 is still engaged
    c.handle(status("r1", K1))
    assert run_of(c.handle(Tick(now=2, record=K1))).members == ("r0", "r1")


def test_settling_is_bounded_by_settle_s() -> None:
    c = core(settle_s=50)
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(Tick(now=10, record=K0))
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))  # settles until 60
    report(c, owners=K1, receivers={"r0": K1})
    assert of(RunTransition, c.handle(Tick(now=59, record=K1))) == []
    out = c.handle(Tick(now=60, record=K1))
    assert run_of(out).members == ("r0",) and run_of(out).not_waiting == ("r1",)
    assert [s.receiver for s in of(StartDense, out)] == ["r1"]


def test_a_replaced_coordinators_end_does_not_settle() -> None:
    c = core(settle_s=50)
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(TransitionDone(record=K0, epoch=1, replaced=True))
    assert c.running is None
    # Nothing to wait for: r0 and r1 are no longer engaged.
    out = c.handle(Tick(now=1, record=K0))
    assert run_of(out).base == K0


def test_disproved_members_stay_unverified_and_the_others_become_verified() -> None:
    c = core()
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset({"r0"})))
    assert c.unverified == {"r0"}


def test_without_a_judged_proof_nobody_becomes_verified() -> None:
    c = core()
    report(c)
    run_of(c.handle(Tick(now=0, record=K0)))
    c.handle(TransitionDone(record=K0, epoch=1, disproved=None))
    assert c.unverified == {"r0", "r1"}


def test_a_transition_that_did_not_fingerprint_verifies_nobody() -> None:
    c = core(fingerprint_on_join=False)
    report(c)
    assert not run_of(c.handle(Tick(now=0, record=K0))).fingerprint
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))
    assert c.unverified == {"r0", "r1"}


# -- dense job ids --------------------------------------------------------------------------


def test_job_ids_lie_above_every_attempt_id_of_the_epoch_and_increase() -> None:
    c = core(epoch=3, retry_s=0.0)
    report(c, staged=False, receivers={"r0": None, "r1": None})
    ids = [s.job for s in of(StartDense, c.handle(Tick(now=0, record=K0)))]
    for job in list(ids):
        c.handle(msg.AttemptFailed(attempt=job, endpoint="o0", check="version"))
    ids += [s.job for s in of(StartDense, c.handle(Tick(now=1, record=K0)))]
    assert len(ids) == 4 and ids == sorted(set(ids))
    attempts = EpochIds(3).attempts()
    first_attempt = attempts.fresh()[0]
    assert first_attempt == 3 << 32
    assert all((3 << 32) + (1 << 31) < j < (4 << 32) for j in ids)  # above 2**31 attempts
    assert all(j < EpochIds(4).attempts().fresh()[0] for j in ids)


def test_after_a_run_claimed_a_newer_epoch_job_ids_lie_above_the_old_epoch() -> None:
    c = core(epoch=1)
    report(c, receivers={"r0": K0, "r1": None})
    out = c.handle(Tick(now=0, record=K0))
    [old] = of(StartDense, out)
    run_of(out)
    c.handle(TransitionDone(record=K1, epoch=2, disproved=frozenset()))
    assert c.epoch == 2
    report(c, owners=K1, receivers={"r0": K1})
    out = c.handle(Tick(now=2, record=K1))
    [new] = of(StartDense, out)
    assert new.receiver == "r1" and new.job > old.job
    assert new.job > (1 << 32) | 0xFFFF_FFFF  # above every id epoch 1 can issue
    assert new.job == (2 << 32) | (1 << 31) | 1
    # A lower epoch reported later does not move the ids back.
    c.handle(TransitionDone(record=K1, epoch=1, disproved=None))
    assert c.epoch == 2


# -- saying which members never reported ----------------------------------------------------


def test_silent_members_are_named_after_silent_s_and_not_more_often() -> None:
    c = core(silent_s=30)
    c.handle(status("o0", K0))
    c.handle(status("r1", K0))
    assert said("waiting", c.handle(Tick(now=100, record=K0))) == []  # active since 100
    assert said("waiting", c.handle(Tick(now=129.9, record=K0))) == []
    expected = {"owners": ["o1"], "receivers": ["r0"]}
    assert said("waiting", c.handle(Tick(now=130, record=K0))) == [expected]
    assert said("waiting", c.handle(Tick(now=159.9, record=K0))) == []
    assert said("waiting", c.handle(Tick(now=160, record=K0))) == [expected]
    assert c.silent() == (["o1"], ["r0"])
    c.handle(status("o1", K0))
    c.handle(status("r0", K0))
    assert said("waiting", c.handle(Tick(now=500, record=K0))) == []


def test_a_receiver_a_transition_asked_to_restore_is_not_trusted_on_its_stale_report() -> None:
    """A disproved member still reports the base record (its storage was never written); the
    job the transition asked for is neither released on that report nor dropped when it
    fails (busy, still stopping its attempt): it is sent again, and the receiver is no member
    until it reports the job done."""
    c = core()
    report(c, staged=False, receivers={"r0": K0, "r1": K0})
    [asked] = of(StartDense, c.handle(DenseAsked(record=K0, receivers=frozenset({"r0"}))))
    assert of(ReleaseJob, c.handle(Tick(now=0, record=K0))) == []
    assert c.jobs() == {"r0": asked.job} and c.members(K0) == ("r1",)
    c.handle(msg.AttemptFailed(attempt=asked.job, endpoint="r0", check="busy"))
    [again] = of(StartDense, c.handle(Tick(now=5, record=K0)))
    assert again.job > asked.job and c.members(K0) == ("r1",)
    out = c.handle(msg.ReceiverReady(receiver="r0", record=K0, job=again.job))
    assert of(ReopenGate, out) and c.members(K0) == ("r0", "r1")
