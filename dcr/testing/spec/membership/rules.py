"""The membership core's rules in ``models/membership.tla``: a mirror of
:class:`dcr.protocol.membership.MembershipCore`, one function per event or tick decision.

* :func:`report` -- an endpoint's status reaches the core (``_on_status``: first sight and
  restarts make a receiver unverified; a restart releases its job);
* :func:`ready` -- a ``ReceiverReady`` reaches it (``_on_ready``: the job is released and the
  gate reopened when it restored the job's record);
* :func:`refit` -- the tick's dense-refit decision for one receiver (``_refit_joiners``);
* :func:`settle` -- settling ends (members reported, or ``settle_s`` passed);
* :func:`run_transition` -- the tick starts a transition (``_on_tick``: owners staged, or an
  unfinished attempt of a replaced coordinator to take over);
* :func:`transition_done` -- ``TransitionDone`` (``_on_done``: verification, settling, the
  epoch of the ids).

Time is abstract: every deadline (``join_wait_s``, ``retry_s``, ``dense_timeout_s``,
``settle_s``) may pass between any two steps, within the budgets of the configuration.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dcr.protocol.lifecycle import ReceiverPhase
from dcr.testing.spec.membership.state import (
    NOTHING,
    Core,
    DenseCall,
    Job,
    Reopen,
    Run,
    RunConfig,
    State,
    Status,
    job_id,
)

_R = ReceiverPhase

__all__ = [
    "Draft",
    "RunStep",
    "owners_staged",
    "ready",
    "refit",
    "report",
    "retire",
    "run_transition",
    "settle",
    "start_job",
    "stop_bound",
    "transition_done",
    "unfinished",
]


@dataclass(frozen=True, slots=True)
class RunStep:
    """One successor of the membership model."""

    label: str
    state: State
    edges: tuple[()] = ()


class Draft:
    """A state being rewritten by one action."""

    def __init__(self, s: State) -> None:
        self.s = s
        self.changes: dict[str, Any] = {}
        self.core = s.core
        self.receivers = list(s.receivers)
        self.owners = list(s.owners)

    def __getattr__(self, name: str) -> Any:
        # Fields not rewritten yet read through to the state.
        changes = self.__dict__.get("changes", {})
        return changes[name] if name in changes else getattr(self.__dict__["s"], name)

    def set(self, **changes: Any) -> None:
        self.changes.update(changes)

    def receiver(self, r: int, **changes: Any) -> None:
        self.receivers[r] = self.receivers[r]._replace(**changes)

    def owner(self, o: int, **changes: Any) -> None:
        self.owners[o] = self.owners[o]._replace(**changes)

    def edit_core(self, **changes: Any) -> None:
        self.core = self.core._replace(**changes)

    def job(self, r: int, job: Job | None) -> None:
        jobs = list(self.core.jobs)
        jobs[r] = job
        self.edit_core(jobs=tuple(jobs))

    def step(self, label: str) -> RunStep:
        # Payloads no call in flight and no receiver's job refers to can never be applied:
        # forgetting them merges states that behave alike.
        wanted = {c.job for c in self.to_receivers}
        wanted |= {rx.dense.job for rx in self.receivers if rx.dense is not None}
        sent = frozenset(x for x in self.sent if x[0] in wanted)
        return RunStep(
            label,
            self.s.evolve(
                core=self.core,
                receivers=tuple(self.receivers),
                owners=tuple(self.owners),
                **{**self.changes, "sent": sent},
            ),
        )


def start_job(d: Draft, r: int, record: int) -> None:
    """``_start_job``: a fresh job of the core's epoch replaces the receiver's earlier one; the
    owners and the receiver are called."""
    issued = d.core.issued + 1
    job = job_id(d.core.epoch, issued)
    d.edit_core(issued=issued)
    d.job(r, Job(job, record, False))
    call = DenseCall(job, r, record, d.lease)
    d.set(to_receivers=d.to_receivers | {call})
    # The owners send every element at their baseline, or refuse when it is not the job's
    # record (the active coordinator's calls carry the newest epoch: their link takes them).
    if all(o.baseline == record for o in d.owners):
        d.set(sent=d.sent | {(job, record)})
    else:
        d.job(r, Job(job, record, True))


def report(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A receiver's status report (its current one: reports of one process arrive in order)
    reaches the core."""
    for r, rx in enumerate(s.receivers):
        now = Status(rx.inc, rx.held)
        before = s.core.receivers[r]
        if before == now or any(m.receiver == r and m.inc == rx.inc for m in s.readies):
            continue  # (a process's reports arrive in order: its ReceiverReady first)
        d = Draft(s)
        views = list(s.core.receivers)
        views[r] = now
        d.edit_core(receivers=tuple(views))
        if before is None:
            # Seen for the first time: fingerprinted before it takes part.
            d.edit_core(unverified=d.core.unverified | {r})
        elif before.inc != now.inc:
            # A new process: the old one is gone (Retire), its job is released.
            d.edit_core(restarted=d.core.restarted | {r}, unverified=d.core.unverified | {r})
            d.job(r, None)
            if s.run is not None:
                retire(d, s.run, r, cfg)
        yield d.step(f"report(r{r})")


def retire(d: Draft, run: Run, r: int, cfg: RunConfig) -> None:
    """``Retire``: the running transition learns that ``r``'s old process is gone.  The
    coordinator core takes it out of the membership and fails the attempt it is bound to --
    once the run prepared an attempt (before that, the fleet coordinator has nothing to tell
    unless ``early_retire``)."""
    if run.committed or (not run.tries and not cfg.early_retire):
        return
    new = run._replace(members=run.members - {r})
    if run.attempt and any(x == r for x, _ in run.bound):
        stop_bound(d, run)
        new = new._replace(attempt=0, bound=frozenset(), applied=frozenset(), overwrite=True)
    d.set(run=new)


def stop_bound(d: Draft, run: Run) -> None:
    """The attempt ends without a commit: its receivers stop and clean up (writes that
    landed stay: the receiver is dirty)."""
    for r, inc in run.bound:
        rx = d.receivers[r]
        if rx.inc == inc and rx.phase in (_R.PREPARED, _R.ACKED):
            d.receiver(r, phase=_R.CLEANED, acked=NOTHING)


def ready(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A ``ReceiverReady`` reaches the core (it names the job, not the process)."""
    for m in sorted(s.readies):
        r, record = m.receiver, m.record
        d = Draft(s)
        d.set(readies=s.readies - {m})
        tracked = s.core.jobs[r]
        if tracked is None or tracked.job != m.job:
            # A job the core no longer runs: a late report of a process that restarted
            # since, or of a job a newer one replaced.
            yield d.step(f"ready(r{r},i{m.inc},v{record},late)")
            continue
        d.edit_core(unverified=d.core.unverified | {r})
        status = s.core.receivers[r]
        if status is not None:
            views = list(s.core.receivers)
            views[r] = status._replace(record=record)
            d.edit_core(receivers=tuple(views))
        job = s.core.jobs[r]
        if job is not None and job.record == record:
            d.job(r, None)
            d.set(reopens=s.reopens | {Reopen(job.job, r, record, s.lease)})
        yield d.step(f"ready(r{r},i{m.inc},v{record})")


def refit(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """The tick's ``_refit_joiners`` for one receiver: release the job of a receiver that
    reports the record; start (or send again) the job of one that does not."""
    record = s.record
    for r in range(len(s.receivers)):
        status, job = s.core.receivers[r], s.core.jobs[r]
        if status is None:
            continue
        if status.record == record:
            if job is not None:
                d = Draft(s)
                d.job(r, None)
                yield d.step(f"refit(r{r},release)")
            continue
        if r in s.core.engaged and (job is None or job.record != record):
            continue  # part of the running transition: restored only when it asks
        if job is None or job.record != record:
            d = Draft(s)
            start_job(d, r, record)
            yield d.step(f"refit(r{r})")
        elif job.failed and s.budgets.retries:
            d = Draft(s)
            start_job(d, r, record)
            d.set(budgets=s.budgets._replace(retries=s.budgets.retries - 1))
            yield d.step(f"refit(r{r},retry)")
        elif not job.failed and s.budgets.timeouts:
            d = Draft(s)
            start_job(d, r, record)
            d.set(budgets=s.budgets._replace(timeouts=s.budgets.timeouts - 1))
            yield d.step(f"refit(r{r},timeout)")


def settled(s: State, core: Core) -> bool:
    """``_settled``: the receivers that took part report the committed record (or restarted,
    or must restore one)."""
    for r in core.engaged:
        st = core.receivers[r]
        if st is None or not (
            st.record == core.settling or st.record == NOTHING or r in core.restarted
        ):
            return False
    return True


def settle(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Settling ends: the members reported, or ``settle_s`` passed."""
    if s.core.settling == NOTHING:
        return
    if settled(s, s.core):
        d = Draft(s)
        d.edit_core(settling=NOTHING, engaged=frozenset())
        yield d.step("settle")
    elif s.budgets.settle_timeouts:
        d = Draft(s)
        d.edit_core(settling=NOTHING, engaged=frozenset())
        d.set(budgets=s.budgets._replace(settle_timeouts=s.budgets.settle_timeouts - 1))
        yield d.step("settle(timeout)")


def owners_staged(s: State) -> bool:
    return all(o.baseline == s.record and o.staged for o in s.owners)


def unfinished(s: State) -> bool:
    """``_unfinished``: the last registered attempt is a replaced coordinator's and not
    finished -- not committed while every owner still holds a candidate, or committed while
    some owner has not moved its baseline."""
    info = s.registered
    if info is None or info.epoch >= s.core.epoch:
        return False
    if s.record == info.base and all(o.staged for o in s.owners):
        return True
    return s.record == info.base + 1 and any(o.baseline == info.base for o in s.owners)


def run_transition(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """The tick starts a transition; its run claims a new epoch at the commit store."""
    if s.run is not None or s.core.settling != NOTHING:
        return
    old = unfinished(s)
    if not old and not owners_staged(s):
        return
    joining = any(st is None or st.record != s.record for st in s.core.receivers)
    budgets = s.budgets
    if not old and joining:
        if not budgets.join_waits:
            return  # waits for the joiners (join_wait_s has not passed)
        budgets = budgets._replace(join_waits=budgets.join_waits - 1)
    info = s.registered
    base = info.base if old and info is not None else s.record
    members = frozenset(
        r for r, st in enumerate(s.core.receivers) if st is not None and st.record == base
    )
    fingerprint = cfg.fingerprint_on_join and bool(s.core.unverified & members)
    epoch = s.lease + 1
    d = Draft(s)
    d.edit_core(engaged=members, restarted=frozenset())
    d.set(
        lease=epoch,
        budgets=budgets,
        run=Run(
            base=base,
            required=members,
            members=info.receivers if old and info is not None else members,
            fingerprint=fingerprint,
            # A takeover treats the old attempt as admitted: no proof is asked after admission.
            proving=fingerprint and not old,
            take_over=old,
            epoch=epoch,
            attempt=0,
            tries=0,
            overwrite=old,
            bound=frozenset(),
            applied=frozenset(),
            committed=old and s.record == base + 1,
            reported=frozenset(),
            disproved=None,
        ),
    )
    yield d.step("run_transition(take_over)" if old else "run_transition")


def transition_done(d: Draft, run: Run, cfg: RunConfig) -> None:
    """``TransitionDone``: members the fingerprint did not disprove become verified; the next
    transition waits for the members to settle; ids continue in the run's epoch."""
    core = d.core
    if run.fingerprint and run.disproved is not None:
        checked = run.required - run.disproved
        if not cfg.verify_restarted:
            checked -= core.restarted
        d.edit_core(unverified=core.unverified - checked)
    d.edit_core(settling=d.record)
    if run.epoch > core.epoch:
        d.edit_core(epoch=run.epoch, issued=0)
    d.set(run=None)
