"""The actions of ``models/membership.tla``: the membership core's rules
(:mod:`~dcr.testing.spec.membership.rules`), one transition's abstract progress, the
endpoints' side of dense refits and gate reopenings, and the environment (restarts,
foreign checkpoints, takeovers, lost dense payloads).

One transition, abstractly: ``prepare`` binds the receiver processes that accept (a receiver
accepts only at the base record, with no dense job running, and not in mixed mode when writes
landed since), judges the fingerprint of a fingerprinting prepare (a disproved receiver is
sent to a dense refit) and admits the attempt; ``apply`` lands one receiver's payloads (an XOR
entry is exact only on its own base); ``fail_attempt`` follows a bound process that is gone;
``commit`` is the compare-and-set; ``baseline_update`` and ``reopen`` end the transition.
The sample proof is assumed to miss (only the fingerprint catches a wrong base).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from dcr.protocol.lifecycle import ReceiverPhase, Trigger
from dcr.testing.spec.membership.rules import (
    Draft,
    RunStep,
    ready,
    refit,
    report,
    run_transition,
    settle,
    start_job,
    stop_bound,
    transition_done,
)
from dcr.testing.spec.membership.state import (
    BAD,
    LOST,
    MIXED,
    NOTHING,
    Budgets,
    Commit,
    Core,
    Job,
    Owner,
    Ready,
    Receiver,
    Registered,
    RunConfig,
    State,
    attempt_id,
)
from dcr.testing.spec.steps import NEXT

__all__ = ["ACTIONS", "ENVIRONMENT", "MembershipAction", "initial_state"]

_R = ReceiverPhase

MembershipAction = Callable[[State, RunConfig], Iterator[RunStep]]
"""An action: the steps it allows from a state."""


def _can(phase: ReceiverPhase, trigger: Trigger) -> bool:
    """Whether the lifecycle table has an edge for ``trigger`` from ``phase``."""
    return (phase, trigger) in NEXT


def fresh_core(epoch: int, cfg: RunConfig) -> Core:
    """The membership core of a coordinator that just became active."""
    return Core(
        epoch=epoch,
        issued=0,
        receivers=(None,) * cfg.receivers,
        unverified=frozenset(),
        restarted=frozenset(),
        jobs=(None,) * cfg.receivers,
        engaged=frozenset(),
        settling=NOTHING,
    )


def initial_state(cfg: RunConfig) -> State:
    """Version 0 committed and held by every endpoint; coordinator 1 became active and has
    heard from nobody yet."""
    return State(
        record=0,
        lease=1,
        generation=1,
        registered=None,
        core=fresh_core(1, cfg),
        run=None,
        owners=tuple(Owner(inc=0, baseline=0, staged=False) for _ in range(cfg.owners)),
        receivers=tuple(
            Receiver(
                phase=_R.READY,
                inc=0,
                storage=0,
                held=0,
                dirty=False,
                gate=True,
                seen=0,
                dense=None,
                acked=NOTHING,
                foreign=False,
            )
            for _ in range(cfg.receivers)
        ),
        to_receivers=frozenset(),
        sent=frozenset(),
        reopens=frozenset(),
        readies=frozenset(),
        stale_epoch=0,
        commits=(),
        budgets=Budgets(
            restarts=cfg.restarts,
            checkpoints=cfg.checkpoints,
            foreign=cfg.foreign,
            owner_restarts=cfg.owner_restarts,
            takeovers=cfg.takeovers,
            dense_failures=cfg.dense_failures,
            timeouts=cfg.timeouts,
            settle_timeouts=cfg.settle_timeouts,
            join_waits=cfg.join_waits,
        ),
    )


# -- one transition, abstractly ------------------------------------------------------------


def prepare(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Register and prepare an attempt; judge the fingerprint; admit it or fail it."""
    run = s.run
    if run is None or run.committed or run.attempt:
        return
    if s.lease != run.epoch or s.record != run.base:
        return  # the control plane registers only the active coordinator's attempt
    if any(not (o.staged and o.baseline == run.base) for o in s.owners):
        return  # an owner holds the prepare until its trainer staged on the base
    for r in run.members:
        st = s.core.receivers[r]
        if st is None or st.inc != s.receivers[r].inc:
            return  # the process that would answer said hello first (one connection, in order)
    d = Draft(s)
    tau = attempt_id(run.epoch, run.tries)
    bound: set[tuple[int, int]] = set()
    left: set[int] = set()
    for r in sorted(run.members):
        rx = d.receivers[r]
        if rx.phase in (_R.PREPARED, _R.ACKED) and rx.seen < run.epoch:
            # A replaced coordinator's attempt: stopped and cleaned up first (takeover).
            d.receiver(r, phase=_R.CLEANED, acked=NOTHING)
            rx = d.receivers[r]
        accepts = (
            rx.seen <= run.epoch
            and _can(rx.phase, Trigger.PREPARE)
            and rx.dense is None
            and rx.held == run.base
            and (run.overwrite or not rx.dirty)
        )
        if accepts:
            bound.add((r, rx.inc))
            d.receiver(r, phase=_R.PREPARED, seen=run.epoch)
        else:
            left.add(r)  # joining, another version, busy: it leaves the membership
    members = run.members - left
    registered = Registered(run.epoch, tau, run.base, frozenset(members))
    d.set(registered=registered)
    disproved: frozenset[int] | None = run.disproved
    if run.proving:
        disproved = frozenset(r for r, _ in bound if d.receivers[r].storage != run.base)
        for r in sorted(disproved):
            # Disproved: it no longer claims a record, closes its gate and is restored.
            d.receiver(r, phase=_R.CLEANED, held=NOTHING, gate=False)
            start_job(d, r, run.base)
    new = run._replace(members=members - (disproved or frozenset()), proving=False,
                       disproved=disproved, tries=run.tries + 1)  # fmt: skip
    if run.proving and disproved:
        stop_bound(d, run._replace(bound=frozenset(bound)))
        d.set(run=new)
        yield d.step("prepare(disproved)")
        return
    for r, _ in bound:
        d.receiver(r, gate=False)  # admitted: the gate closes
    d.set(run=new._replace(attempt=tau, bound=frozenset(bound), applied=frozenset()))
    yield d.step("prepare")


def apply(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A bound receiver applies the attempt's payloads and acknowledges."""
    run = s.run
    if run is None or not run.attempt or run.committed:
        return
    for r, inc in sorted(run.bound):
        rx = s.receivers[r]
        if rx.inc != inc or r in run.applied or rx.phase is not _R.PREPARED:
            continue
        target = run.base + 1
        storage = target if run.overwrite or rx.storage == run.base else BAD
        d = Draft(s)
        d.receiver(r, phase=_R.ACKED, storage=storage, dirty=True, acked=target)
        d.set(run=run._replace(applied=run.applied | {r}))
        yield d.step(f"apply(r{r})")


def fail_attempt(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A bound process is gone (retired, or its deadline passed): the attempt fails and the
    retry, in overwrite mode, goes without it."""
    run = s.run
    if run is None or not run.attempt or run.committed:
        return
    gone = frozenset(r for r, inc in run.bound if s.receivers[r].inc != inc)
    if not gone:
        return
    d = Draft(s)
    stop_bound(d, run)
    d.set(run=run._replace(attempt=0, bound=frozenset(), applied=frozenset(), overwrite=True,
                           members=run.members - gone))  # fmt: skip
    yield d.step("fail_attempt")


def commit(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Every bound process acknowledged: the compare-and-set ``base -> base + 1``."""
    run = s.run
    if run is None or not run.attempt or run.committed:
        return
    if any(s.receivers[r].inc != inc or r not in run.applied for r, inc in run.bound):
        return
    info = s.registered
    if s.lease != run.epoch or s.record != run.base or info is None or info.attempt != run.attempt:
        return
    missing = frozenset((r, inc) for r, inc in run.bound if r not in run.applied)
    d = Draft(s)
    d.set(
        record=run.base + 1,
        run=run._replace(committed=True),
        commits=(*s.commits, Commit(run.epoch, s.lease, missing)),
    )
    yield d.step("commit")


def baseline_update(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """An owner reads the record and updates its baseline (a restarted owner that already
    holds it reports at once)."""
    run = s.run
    if run is None or not run.committed:
        return
    for o, ow in enumerate(s.owners):
        if o in run.reported:
            continue
        d = Draft(s)
        if ow.baseline == run.base:
            d.owner(o, baseline=s.record, staged=False)
        d.set(run=run._replace(reported=run.reported | {o}))
        yield d.step(f"baseline_update(o{o})")


def reopen(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Every owner updated its baseline: receivers that acknowledged the committed attempt
    drop their KV cache and reopen; the run reports ``TransitionDone``."""
    run = s.run
    if run is None or not run.committed or len(run.reported) < len(s.owners):
        return
    d = Draft(s)
    for r, rx in enumerate(s.receivers):
        if rx.phase in (_R.ACKED, _R.CLEANED) and rx.acked == s.record and rx.seen <= run.epoch:
            d.receiver(r, phase=_R.READY, held=s.record, dirty=False, gate=True,
                       acked=NOTHING, seen=run.epoch)  # fmt: skip
    transition_done(d, run, cfg)
    yield d.step("reopen")


# -- the endpoints' side of dense refits and gate reopenings -------------------------------


def stage(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A trainer rank stages the next version on its baseline (``CandidateStaged``)."""
    for o, ow in enumerate(s.owners):
        if not ow.staged and ow.baseline < cfg.transitions:
            d = Draft(s)
            d.owner(o, staged=True)
            yield d.step(f"stage(o{o})")


def _failed(d: Draft, r: int, job: int) -> None:
    """``AttemptFailed`` of a dense job reaches the core: sent again soon if it tracks it."""
    tracked = d.core.jobs[r]
    if tracked is not None and tracked.job == job:
        d.job(r, tracked._replace(failed=True))


def receive_dense(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """The receiver gets a dense call: it starts the job where the lifecycle allows a dense
    refit and, serving, only a newer record than its own (a newer job replaces one running),
    closing its gate first, or refuses it."""
    for call in sorted(s.to_receivers):
        r = call.receiver
        rx = s.receivers[r]
        d = Draft(s)
        d.set(to_receivers=s.to_receivers - {call})
        label = f"receive_dense(j{call.job & 0xFF},r{r})"
        if call.epoch < rx.seen:
            yield d.step(label)  # the link refuses a replaced coordinator's call
            continue
        d.receiver(r, seen=call.epoch)
        if rx.dense is not None and rx.dense.job >= call.job:
            pass  # a repeated or older call
        elif _can(rx.phase, Trigger.DENSE_REFIT) and not (
            rx.phase is _R.READY and rx.held >= call.record
        ):
            d.receiver(r, dense=Job(call.job, call.record, False), gate=False)
        else:
            _failed(d, r, call.job)  # busy
        yield d.step(label)


def restore(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Every payload of the receiver's job arrived: it holds the job's record exactly."""
    for r, rx in enumerate(s.receivers):
        job = rx.dense
        if job is None or (job.job, job.record) not in s.sent:
            continue
        d = Draft(s)
        d.receiver(r, phase=_R.REFITTED, storage=job.record, held=job.record, dirty=False,
                   gate=False, dense=None, acked=NOTHING, foreign=False)  # fmt: skip
        d.set(readies=s.readies | {Ready(r, rx.inc, job.job, job.record)})
        yield d.step(f"restore(r{r})")


def reopen_gate(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A restored receiver's ``ReopenGate`` arrives: it serves again if it holds the record
    exactly (a replaced coordinator's call is refused by the link)."""
    for call in sorted(s.reopens):
        r = call.receiver
        rx = s.receivers[r]
        d = Draft(s)
        d.set(reopens=s.reopens - {call})
        if call.epoch >= rx.seen and rx.phase is not _R.READY:
            d.receiver(r, seen=call.epoch)
            holds = rx.held == call.record and not rx.dirty
            if not cfg.reopen_while_restoring and rx.dense is not None:
                holds = False  # (the proposed fix: not while a dense job runs)
            if _can(rx.phase, Trigger.REOPEN_GATE) and holds:
                d.receiver(r, phase=_R.READY, gate=True)
        yield d.step(f"reopen_gate(r{r},v{call.record})")


# -- environment ---------------------------------------------------------------------------


def _fresh_receiver(rx: Receiver, **changes: Any) -> Receiver:
    return rx._replace(inc=rx.inc + 1, seen=0, dense=None, acked=NOTHING, dirty=False,
                       foreign=False, **changes)  # fmt: skip


def restart_receiver(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A receiver process dies; a new one starts empty, from the committed checkpoint, or
    (``foreign``) claiming the record from a checkpoint whose bits are not it."""
    for r, rx in enumerate(s.receivers):
        starts: list[tuple[str, Receiver, Budgets]] = []
        b = s.budgets
        if b.restarts:
            empty = _fresh_receiver(rx, phase=_R.JOINING, storage=LOST, held=NOTHING, gate=False)
            starts.append(("empty", empty, b._replace(restarts=b.restarts - 1)))
        if b.checkpoints:
            ready_ = _fresh_receiver(rx, phase=_R.READY, storage=s.record, held=s.record,
                                     gate=True)  # fmt: skip
            starts.append(("checkpoint", ready_, b._replace(checkpoints=b.checkpoints - 1)))
        if s.budgets.foreign:
            # Serving a foreign checkpoint before the protocol touches it is outside the
            # protocol: its gate is taken as closed.
            foreign = _fresh_receiver(rx, phase=_R.READY, storage=LOST, held=s.record,
                                      gate=False)._replace(foreign=True)  # fmt: skip
            starts.append(("foreign", foreign, s.budgets._replace(foreign=s.budgets.foreign - 1)))
        for how, new, budgets in starts:
            d = Draft(s)
            d.receivers[r] = new
            d.set(budgets=budgets)
            yield d.step(f"restart_receiver(r{r},{how})")


def lose_dense(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Part of a dense job's payloads never arrives: the receiver fails the job after the
    part that landed (its storage is a mixture) and the core sends it again."""
    if not s.budgets.dense_failures:
        return
    for r, rx in enumerate(s.receivers):
        job = rx.dense
        if job is None or (job.job, job.record) not in s.sent:
            continue
        d = Draft(s)
        # (Payloads of the record it holds rewrite the same bits.)
        storage = rx.storage if job.record == rx.storage else MIXED
        d.receiver(r, storage=storage, dirty=True, dense=None)
        _failed(d, r, job.job)
        d.set(budgets=s.budgets._replace(dense_failures=s.budgets.dense_failures - 1))
        yield d.step(f"lose_dense(r{r})")


def restart_owner(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A trainer rank restarts at the committed record; its candidate is gone (the attempt
    in progress fails; the retry waits until the candidate is staged again)."""
    if not s.budgets.owner_restarts:
        return
    for o, ow in enumerate(s.owners):
        d = Draft(s)
        d.owner(o, inc=ow.inc + 1, baseline=s.record, staged=False)
        run = s.run
        if run is not None and run.attempt and not run.committed:
            stop_bound(d, run)
            d.set(run=run._replace(attempt=0, bound=frozenset(), applied=frozenset(),
                                   overwrite=True))  # fmt: skip
        d.set(budgets=s.budgets._replace(owner_restarts=s.budgets.owner_restarts - 1))
        yield d.step(f"restart_owner(o{o})")


def take_over(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A standby claims a newer epoch (the active coordinator's lease lapsed): it starts with
    a fresh membership core; the replaced one stands down, its calls still in flight."""
    if not s.budgets.takeovers or s.run is None:
        return  # (the active coordinator is replaced during a transition)
    d = Draft(s)
    epoch = s.lease + 1
    d.core = fresh_core(epoch, cfg)
    d.set(
        lease=epoch,
        generation=s.generation + 1,
        run=None,
        stale_epoch=s.core.epoch,
        budgets=s.budgets._replace(takeovers=s.budgets.takeovers - 1),
    )
    yield d.step("take_over")


ACTIONS: dict[str, MembershipAction] = {
    "report": report,
    "ready": ready,
    "refit": refit,
    "settle": settle,
    "run_transition": run_transition,
    "prepare": prepare,
    "apply": apply,
    "fail_attempt": fail_attempt,
    "commit": commit,
    "baseline_update": baseline_update,
    "reopen": reopen,
    "stage": stage,
    "receive_dense": receive_dense,
    "restore": restore,
    "reopen_gate": reopen_gate,
    "restart_receiver": restart_receiver,
    "restart_owner": restart_owner,
    "lose_dense": lose_dense,
    "take_over": take_over,
}
"""Every action of ``models/membership.tla``, by name (the TLA+ name in snake case)."""

ENVIRONMENT = frozenset({"restart_receiver", "restart_owner", "lose_dense", "take_over"})
"""Faults rather than protocol steps."""
