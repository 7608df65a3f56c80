"""Departure: a receiver gone for good leaves the fleet (``Departed``), on the real cores.

The membership core forgets it (no longer a member, a joiner or silent) and tells a running
transition (``Depart``); the transition core takes it out of the next attempts and retires it
from the current one, which goes on -- fails and retries -- without it.  A departed receiver
that reports again rejoins as one seen for the first time.
"""

from __future__ import annotations

from test_join_wait import _disprove_r0, _registered
from test_membership import K0, K1, core, of, report, run_of, said, status
from test_scenarios import attempts, committed_everywhere, make, some_write_landed, storage

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
from dcr.protocol.lifecycle import AttemptPhase, ReceiverPhase
from dcr.protocol.membership import (
    Depart,
    MembershipCommand,
    ReleaseJob,
    RunTransition,
    StartDense,
    Tick,
    TransitionDone,
)
from dcr.protocol.types import CommitRecord, CounterIds, Mode, TransitionOutcome
from dcr.testing.protocol_world import World
from dcr.testing.spec.state import V0, V1
from dcr.testing.world_messages import Message

# -- the transition core, through the in-memory world -------------------------------------


def _to(name: str) -> object:
    return lambda m: m.to == name


def test_a_departure_mid_transition_lets_it_commit_with_the_receivers_left() -> None:
    """r2 is gone after writes landed: the attempt is retired from it and fails, and the
    overwrite retry commits with r0 and r1 alone, without any deadline expiring."""
    w = make()
    w.run(until=some_write_landed)
    tau1 = attempts(w)[0].info
    assert "r2" in tau1.receivers
    w.depart("r2")
    w.run(hold=_to("r2"))
    assert w.outcome() is TransitionOutcome.COMMITTED
    prepares = attempts(w)
    assert len(prepares) == 2
    tau2 = prepares[1].info
    assert tau2.mode is Mode.OVERWRITE and tau2.receivers == frozenset({"r0", "r1"})
    assert w.record.version == 1
    committed_everywhere(w, ("r0", "r1"))
    assert not w.coordinators[1].members & {"r2"}
    # The stop path and cleanup of tau1 still address r2: it may only be out of reach.
    held = [m.event for m in w.messages if m.to == "r2"]
    stopped = [e for e in held if isinstance(e, msg.StopAndWait | msg.Cleanup)]
    assert {type(e) for e in stopped} == {msg.StopAndWait, msg.Cleanup}
    assert all(e.attempt == tau1.attempt for e in stopped)
    assert not [e for e in held if isinstance(e, msg.Prepare) and e.info.attempt != tau1.attempt]


def test_a_departed_receiver_that_was_only_out_of_reach_finds_its_attempt_cleaned_up() -> None:
    """When r2 comes back, the calls that waited for it stop and clean up the attempt it was
    part of: it can be restored by dense refit, and it never reopens at the base version."""
    w = make()
    w.run(until=some_write_landed)
    w.depart("r2")
    w.run(hold=_to("r2"))
    assert w.outcome() is TransitionOutcome.COMMITTED
    w.run()  # r2 is back: every call that waited for it arrives
    rx = w.receivers["r2"]
    assert rx.core.phase is ReceiverPhase.CLEANED and not rx.gate_open
    assert storage(w, "r2") <= {V0, V1}
    w.dense_refit("r2")
    assert rx.core.held == w.record and storage(w, "r2") == {V1}


def test_a_departure_before_the_first_prepare_leaves_the_receiver_out() -> None:
    c = CoordinatorCore(
        CoordinatorConfig(base=K0, owners=("o0",), receivers=("r0", "r1"), epoch=1),
        CounterIds(first=1 << 32),
    )
    assert c.handle(ev.Departed(endpoint="r1")) == []
    out = c.handle(ev.StartTransition())
    [register] = [x for x in out if isinstance(x, cmd.RegisterAttempt)]
    assert register.info.receivers == frozenset({"r0"})


def test_a_departure_ends_a_join_wait_that_waited_for_it_alone() -> None:
    """r0's proof failed and the retry waits for its restore; it departs instead: the retry
    prepares at once, without it."""
    c, tau, out = _disprove_r0(join_wait_s=30.0)
    assert _registered(out) == []
    [info] = _registered(c.handle(ev.Departed(endpoint="r0")))
    assert info.attempt > tau and info.receivers == {"r1"}
    # Its ready report, had it come, would not bring it into this attempt any more.
    assert _registered(c.handle(msg.ReceiverReady(receiver="r0", record=K0))) == []


def test_the_departure_of_an_unknown_name_or_an_owner_changes_nothing() -> None:
    w = make()
    w.run(until=some_write_landed)
    c = w.coordinators[1]
    phase, members = c.attempt_phase, c.members
    for name in ("nobody", "o0"):
        assert c.handle(ev.Departed(endpoint=name)) == []
    assert (c.attempt_phase, c.members) == (phase, members)
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, w.receiver_names)


def test_a_world_departure_then_the_same_transition_holds_every_invariant() -> None:
    """Every delivery of the scenarios above is checked against the model's invariants
    (``make``); here with the receiver leaving while its gate is closed."""
    w: World = make()
    w.run(until=lambda w: w.coordinators[1].attempt_phase is AttemptPhase.APPLYING)
    w.depart("r0")
    w.run(hold=_to("r0"))
    assert w.outcome() is TransitionOutcome.COMMITTED
    committed_everywhere(w, ("r1", "r2"))
    held: list[Message] = [m for m in w.messages if m.to == "r0"]
    assert held


# -- the membership core -----------------------------------------------------------------


def test_a_departed_receiver_is_neither_member_nor_joiner_and_is_not_waited_for() -> None:
    """r1 departs between transitions: the next one starts at once (no join wait) with r0."""
    c = core(join_wait_s=60.0)
    report(c, staged=False)
    out = c.handle(ev.Departed(endpoint="r1"))
    assert said("departed", out) == [{"receiver": "r1"}]
    assert "r1" not in c.statuses and c.members(K0) == ("r0",)
    assert c.joining(K0) == set() and c.gone() == ("r1",)
    assert c.silent() == ([], [])
    out = report(c, receivers={"r0": K0}) + c.handle(Tick(now=1.0, record=K0))
    run = run_of(out)
    assert run.members == ("r0",) and run.not_waiting == ()


def test_a_departure_during_a_run_is_handed_to_the_run_and_releases_its_job() -> None:
    c = core()
    report(c, receivers={"r0": K0, "r1": None})
    out = c.handle(Tick(now=0.0, record=K0))
    assert of(StartDense, out) and run_of(out).members == ("r0",)
    [job] = of(StartDense, out)
    out = c.handle(ev.Departed(endpoint="r1"))
    # (the run is told: r1 may have joined one of its attempts)
    assert of(ReleaseJob, out) == [ReleaseJob(job=job.job)] and of(Depart, out)
    assert c.jobs() == {}
    out = c.handle(ev.Departed(endpoint="r0"))
    assert of(Depart, out) == [Depart(endpoint="r0")]
    assert c.restarted() == ("r0", "r1")  # no stop of the run waits for them
    # Its fingerprint in that run does not verify it.
    c.handle(TransitionDone(record=K1, epoch=1, disproved=frozenset()))
    assert "r0" in c.unverified


def test_a_departed_receiver_that_reports_again_rejoins_as_if_seen_first() -> None:
    """Back at the committed record it is a member again, fingerprinted first; back behind
    it, it is restored by dense refit."""
    c = core()
    report(c)
    c.unverified.clear()  # (as if a fingerprint had verified both)
    c.handle(ev.Departed(endpoint="r0"))
    c.handle(ev.Departed(endpoint="r1"))
    out: list[MembershipCommand] = c.handle(status("r0", K1))
    assert said("returned", out) == [{"receiver": "r0"}]
    out += c.handle(status("r1", K0, inc="i1"))
    out += c.handle(Tick(now=1.0, record=K1))
    [dense] = of(StartDense, out)
    assert dense.receiver == "r1" and dense.record == K1
    assert c.members(K1) == ("r0",) and c.gone() == ()
    assert {"r0", "r1"} <= c.unverified
    for o in ("o0", "o1"):
        c.handle(status(o, K1, candidate=True))
    run = run_of(c.handle(Tick(now=2.0, record=K1)))
    assert isinstance(run, RunTransition) and run.members == ("r0",) and run.fingerprint


def test_the_departure_of_an_unknown_name_an_owner_or_a_silent_receiver_is_a_no_op() -> None:
    c = core()
    report(c, receivers={"r0": K0})
    before = (dict(c.statuses), set(c.unverified), c.jobs(), c.silent())
    for name in ("nobody", "o0", "r1"):
        assert c.handle(ev.Departed(endpoint=name)) == []
    assert (dict(c.statuses), set(c.unverified), c.jobs(), c.silent()) == before
    assert c.gone() == ()
    c.handle(ev.Departed(endpoint="r0"))
    assert c.handle(ev.Departed(endpoint="r0")) == []  # departed already


def test_a_transition_core_retires_a_departed_receiver_and_commits_without_it() -> None:
    """The transition core alone: r1 departs while the coordinator waits for its gate."""
    base = CommitRecord(version=0, candidate="g0")
    c = CoordinatorCore(
        CoordinatorConfig(base=base, owners=("o0",), receivers=("r0", "r1"), epoch=1),
        CounterIds(first=1 << 32),
    )
    c.handle(ev.StartTransition())
    tau = c.attempt
    assert tau is not None
    c.handle(ev.Registered(attempt=tau.attempt))
    for e in ("o0", "r0", "r1"):
        c.handle(msg.PrepareAccepted(attempt=tau.attempt, endpoint=e))
    assert c.attempt_phase is AttemptPhase.GATING
    out = c.handle(ev.Departed(endpoint="r1"))
    assert c.attempt_phase is AttemptPhase.OBSOLETE
    assert any(isinstance(x, cmd.RecordObsolete) for x in out)
    out = c.handle(ev.ObsoleteMarked(attempt=tau.attempt))
    [stop] = [x for x in out if isinstance(x, cmd.Call) and isinstance(x.message, msg.StopAndWait)]
    assert stop.to == ("o0", "r0", "r1")
    for e in ("o0", "r0"):
        out = c.handle(msg.Stopped(attempt=tau.attempt, endpoint=e, dirty=False))
    [cleanup] = [x for x in out if isinstance(x, cmd.Call) and isinstance(x.message, msg.Cleanup)]
    assert cleanup.to == ("o0", "r0", "r1")
    tau2 = c.attempt
    assert tau2 is not None and tau2.attempt != tau.attempt
    assert tau2.receivers == frozenset({"r0"})


def test_a_dense_job_never_writes_under_an_open_gate() -> None:
    """A receiver cleaned up after an attempt that failed before admission still serves its
    record; a dense job (it was left out of the next attempts, as after a departure) closes
    the gate first and applies only once the requests in flight drained."""
    from dcr.protocol.receiver import ReceiverCore
    from dcr.protocol.types import AttemptInfo

    rx = ReceiverCore("r0", held=K0)
    info = AttemptInfo(attempt=5, candidate="g1", base=K0, mode=Mode.MIXED, sync=True,
                       coordinator=1, owners=("o0",), receivers=frozenset({"r0"}))  # fmt: skip
    rx.handle(msg.Prepare(info=info))
    rx.handle(msg.MarkObsolete(attempt=5, epoch=1))
    rx.handle(msg.StopAndWait(attempt=5, epoch=1))
    rx.handle(msg.Cleanup(attempt=5))
    assert rx.phase is ReceiverPhase.CLEANED and rx.gate_open
    call = msg.DenseRefit(job=9, record=K1, owners=("o0",), receivers=frozenset({"r0"}))
    out = rx.handle(call)
    assert cmd.CloseGate(attempt=9) in out and not rx.gate_open
    dense = rx._intake.dense
    assert dense is not None and not dense.apply_open
    rx.handle(ev.RequestsDrained(attempt=9))
    assert dense.apply_open
    # A receiver whose gate is closed already starts applying at once.
    joining = ReceiverCore("r1", held=None)
    out = joining.handle(
        msg.DenseRefit(job=9, record=K1, owners=("o0",), receivers=frozenset({"r1"}))
    )
    assert not [c for c in out if isinstance(c, cmd.CloseGate)]
    assert joining._intake.dense is not None and joining._intake.dense.apply_open
