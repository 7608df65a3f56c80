"""Failure and recovery (Algorithm B.2): the actions of ``models/refit.tla`` after an attempt
fails or the transition ends -- fail, reject, mark_obsolete, stop_and_wait, cleanup, the
owners' baseline update, reopen_gate, a coordinator's take_over, the operator's abort and the
dense refit of joining, stale or aborted receivers."""

from __future__ import annotations

from collections.abc import Iterator

from dcr.protocol.lifecycle import AttemptPhase, OwnerPhase, ReceiverPhase, TransitionPhase, Trigger
from dcr.testing.spec.state import EMPTY, NONE, V1, CoordVar, State
from dcr.testing.spec.steps import (
    ATTEMPT_RUNNING,
    NEXT,
    RECEIVER_RUNNING,
    TERMINAL,
    Builder,
    Config,
    Step,
    acting,
    dirty,
    fail_transition,
    live_receivers,
)

__all__ = [
    "abort",
    "baseline_update",
    "cleanup",
    "dense_refit",
    "fail",
    "fail_attempt",
    "mark_obsolete",
    "notice",
    "reject",
    "reopen_gate",
    "stop_and_wait",
    "take_over",
]

_A = AttemptPhase
_T = TransitionPhase
_O = OwnerPhase
_R = ReceiverPhase
_X = Trigger


def fail(s: State, cfg: Config) -> Iterator[Step]:
    """An attempt fails: the coordinator gives up waiting, or a receiver rejects a payload.

    A receiver's report reaches its coordinator in the same step.  That loses no behaviour:
    every other endpoint's progress in between is independent of the failed receiver, so
    the search reaches the same combinations by running that progress first.
    """
    if s.budgets.failures == 0:
        return
    budgets = s.budgets._replace(failures=s.budgets.failures - 1)
    for c, cv in acting(s, cfg):
        if cv.aphase in ATTEMPT_RUNNING:
            b = Builder(s)
            fail_attempt(b, c, cv)
            yield b.step(f"fail(c{c})", budgets=budgets)
    for r, rx in enumerate(s.receivers):
        if rx.phase in RECEIVER_RUNNING:
            b = Builder(s)
            b.receiver(r, phase=b.go(rx.phase, _X.FAIL))
            notice(b, s, cfg, r)
            yield b.step(f"fail(r{r})", budgets=budgets)


def fail_attempt(b: Builder, c: int, cv: CoordVar) -> None:
    b.coord(c, aphase=b.go(cv.aphase, _X.FAIL))
    fail_transition(b, c, cv, _X.FAIL)


def notice(b: Builder, s: State, cfg: Config, r: int) -> None:
    """Coordinators whose running attempt requires receiver ``r`` fail that attempt."""
    for c, cv in acting(s, cfg):
        if cv.aphase in ATTEMPT_RUNNING and any(x == r for x, _ in s.attempt(cv.attempt).required):
            fail_attempt(b, c, cv)


def reject(s: State, cfg: Config) -> Iterator[Step]:
    """A prepare check fails before admission: the transition ends with ``v`` committed."""
    for c, cv in acting(s, cfg):
        if cv.aphase is _A.PREPARING and cv.tphase is _T.ADMITTING:
            b = Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.REJECT), tphase=b.go(cv.tphase, _X.REJECT))
            yield b.step(f"reject(c{c})")


def mark_obsolete(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane refuses the attempt's commit; endpoints ignore its later payloads."""
    for c, cv in acting(s, cfg):
        if cv.aphase is not _A.FAILED:
            continue
        tau = cv.attempt
        b = Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.MARK_OBSOLETE))
        b.attempt(tau, obsolete=True)
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and b.may(ow.phase, _X.MARK_OBSOLETE):
                b.owner(o, phase=b.go(ow.phase, _X.MARK_OBSOLETE))
        for r in live_receivers(s, tau):
            rx = s.receivers[r]
            b.receiver(r, epoch=max(rx.epoch, c))
            if rx.attempt == tau and b.may(rx.phase, _X.MARK_OBSOLETE):
                b.receiver(r, phase=b.go(rx.phase, _X.MARK_OBSOLETE))
        yield b.step(f"mark_obsolete(c{c})")


def stop_and_wait(s: State, cfg: Config) -> Iterator[Step]:
    """Surviving endpoints drain the attempt's writes; crashed receivers are retired."""
    for c, cv in acting(s, cfg):
        if cv.aphase is not _A.OBSOLETE:
            continue
        tau = cv.attempt
        b = Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.STOP_AND_WAIT), stopped=True)
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and ow.phase is _O.OBSOLETE:
                b.owner(o, phase=b.go(ow.phase, _X.STOP_AND_WAIT))
        for r, rx in enumerate(s.receivers):
            if rx.attempt == tau and rx.phase is _R.OBSOLETE:
                b.receiver(r, phase=b.go(rx.phase, _X.STOP_AND_WAIT))
        yield b.step(f"stop_and_wait(c{c})")


def cleanup(s: State, cfg: Config) -> Iterator[Step]:
    """Release the attempt; then retry, end, finish the commit, or wait for dense refits."""
    for c, cv in acting(s, cfg):
        tau = cv.attempt
        b = Builder(s)
        if cv.tphase is _T.FINISHING:
            if cv.reported != frozenset(range(len(s.owners))):
                continue
            b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
        elif cv.tphase in (_T.READMITTING, _T.RECOVERING, _T.REJECTING, _T.ABORTING):
            if cv.aphase is _A.CLEANED and cv.tphase is _T.ABORTING:
                b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
                yield b.step(f"cleanup(c{c})")
                continue
            if cv.aphase is not _A.STOPPING:
                continue
            if cv.tphase in (_T.REJECTING, _T.ABORTING):
                b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
        else:
            continue
        b.coord(c, aphase=b.go(cv.aphase, _X.CLEANUP))
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and ow.phase in (_O.STOPPED, _O.UPDATED):
                b.owner(o, phase=b.go(ow.phase, _X.CLEANUP))
        for r, rx in enumerate(s.receivers):
            if rx.attempt == tau and rx.phase in (_R.STOPPED, _R.ACKED):
                b.receiver(r, phase=b.go(rx.phase, _X.CLEANUP))
        yield b.step(f"cleanup(c{c})")


def baseline_update(s: State, cfg: Config) -> Iterator[Step]:
    """An owner reads ``(v+1, g)``, updates its baseline in place and reports (repeatable)."""
    for c, cv in acting(s, cfg):
        if cv.tphase is not _T.FINISHING or s.record == NONE:
            continue
        for o, ow in enumerate(s.owners):
            if o in cv.reported or (ow.phase, _X.BASELINE_UPDATE) not in NEXT:
                continue
            b = Builder(s)
            b.owner(o, phase=b.go(ow.phase, _X.BASELINE_UPDATE), baseline=V1)
            b.coord(c, tphase=b.go(cv.tphase, _X.BASELINE_UPDATE), reported=cv.reported | {o})
            yield b.step(f"baseline_update(o{o},c{c})")


def reopen_gate(s: State, cfg: Config) -> Iterator[Step]:
    """Receivers drop KV caches and reopen the gate: once the commit is known (those that
    acknowledged it clean up and reopen while the owners still update their baselines), at
    the end of the transition (idempotent for those), or after dense refits."""
    for c, cv in acting(s, cfg):
        b = Builder(s)
        if cv.tphase is _T.FINISHING:
            early = [
                r
                for r, rx in enumerate(s.receivers)
                if rx.attempt == cv.attempt
                and rx.phase is _R.ACKED
                and rx.epoch <= c
                and rx.acked == s.record != NONE
            ]
            if not early:
                continue
            for r in early:
                cleaned = b.go(s.receivers[r].phase, _X.CLEANUP)
                b.receiver(
                    r, phase=b.go(cleaned, _X.REOPEN_GATE), gate_open=True, kv=EMPTY, held=V1
                )
        elif cv.tphase is _T.REOPENING:
            b.coord(c, tphase=b.go(cv.tphase, _X.REOPEN_GATE))
            for r, rx in enumerate(s.receivers):
                # A replaced coordinator's gate call is ignored; a receiver reopens only at a
                # record it holds (it acknowledged the committed attempt).
                if (
                    rx.attempt == cv.attempt
                    and rx.phase is _R.CLEANED
                    and rx.epoch <= c
                    and rx.acked == s.record != NONE
                ):
                    b.receiver(
                        r, phase=b.go(rx.phase, _X.REOPEN_GATE), gate_open=True, kv=EMPTY, held=V1
                    )
        elif cv.tphase is _T.REFITTING:
            # Receivers where writes landed are dense-refitted first; the others hold the
            # committed record and reopen at once.
            if any(rx.phase is _R.CLEANED and dirty(rx) for rx in s.receivers):
                continue
            b.coord(c, tphase=b.go(cv.tphase, _X.REOPEN_GATE))
            for r, rx in enumerate(s.receivers):
                if (
                    rx.attempt == cv.attempt
                    and rx.phase in (_R.CLEANED, _R.REFITTED)
                    and rx.held == s.record_version
                    and not dirty(rx)
                    and rx.epoch <= c
                ):
                    b.receiver(r, phase=b.go(rx.phase, _X.REOPEN_GATE), gate_open=True, kv=EMPTY)
        else:
            continue
        yield b.step(f"reopen_gate(c{c})")


def take_over(s: State, cfg: Config) -> Iterator[Step]:
    """The next coordinator replaces the active one and adopts its last registered attempt."""
    if s.budgets.failovers == 0 or s.coords[s.epoch - 1].tphase in TERMINAL:
        return
    c = s.epoch + 1
    fresh = s.coords[c - 1]
    b = Builder(s)
    budgets = s.budgets._replace(failovers=s.budgets.failovers - 1)
    if s.registered == NONE:
        b.coord(c, started=True)
    else:
        b.coord(
            c,
            started=True,
            tphase=b.go(fresh.tphase, _X.TAKE_OVER),
            aphase=b.go(fresh.aphase, _X.TAKE_OVER),
            attempt=s.registered,
            overwrite=True,
            admitted=True,
        )
    if not cfg.replaced_acts:
        # The replaced coordinator learns of the takeover at once and stands down; only its
        # commit already in flight can still reach the control plane.
        old = s.coords[s.epoch - 1]
        if b.may(old.tphase, _X.CONFLICT):
            b.coord(s.epoch, tphase=b.go(old.tphase, _X.CONFLICT))
        if b.may(old.aphase, _X.CONFLICT):
            b.coord(s.epoch, aphase=b.go(old.aphase, _X.CONFLICT))
    yield b.step(f"take_over(c{c})", epoch=c, budgets=budgets)


def abort(s: State, cfg: Config) -> Iterator[Step]:
    """The operator aborts; not while a commit outcome is pending (it is resolved first)."""
    if s.budgets.aborts == 0:
        return
    for c, cv in acting(s, cfg):
        if s.epoch != c or (cv.tphase, _X.ABORT) not in NEXT:
            continue
        if cv.aphase in (_A.COMMITTING, _A.UNKNOWN, _A.RESOLVING, _A.COMMITTED):
            continue
        b = Builder(s)
        b.coord(c, tphase=b.go(cv.tphase, _X.ABORT))
        if cv.aphase in ATTEMPT_RUNNING:
            b.coord(c, aphase=b.go(cv.aphase, _X.FAIL))
        yield b.step(f"abort(c{c})", budgets=s.budgets._replace(aborts=s.budgets.aborts - 1))


def dense_refit(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver restores the committed version by a dense load and prewarm."""
    refitting = [c for c, cv in acting(s, cfg) if cv.tphase is _T.REFITTING]
    for r, rx in enumerate(s.receivers):
        stale = rx.phase is _R.REFITTED and rx.held != s.record_version
        aborted = rx.phase is _R.CLEANED and dirty(rx) and bool(refitting)
        if not (rx.phase is _R.JOINING or stale or aborted):
            continue
        b = Builder(s)
        b.receiver(
            r,
            phase=b.go(rx.phase, _X.DENSE_REFIT),
            storage=(s.record_version,) * len(s.owners),
            held=s.record_version,
            kv=EMPTY,
            gate_open=False,
            staged=frozenset(),
            applied=frozenset(),
            acked=NONE,
        )
        if aborted:
            for c in refitting:
                b.coord(c, tphase=b.go(s.coords[c - 1].tphase, _X.DENSE_REFIT))
        yield b.step(f"dense_refit(r{r})")
