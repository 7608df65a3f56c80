"""The commit (Algorithm B.2): the actions of ``models/refit.tla`` from the compare-and-set
``K^v -> (v+1, g)`` to its outcome -- succeeded, failed, unknown (a lost reply, resolved by
read_commit once no commit can land) or conflict (replaced, or another coordinator won)."""

from __future__ import annotations

from collections.abc import Iterator

from dcr.protocol.lifecycle import AttemptPhase, TransitionPhase, Trigger
from dcr.testing.spec.state import NONE, Cas, Reply, State
from dcr.testing.spec.steps import NEXT, Builder, Config, Step, acting

__all__ = [
    "commit",
    "commit_failed",
    "commit_succeeded",
    "commit_unknown",
    "compare_and_set",
    "conflict",
    "read_commit",
]

_A = AttemptPhase
_T = TransitionPhase
_X = Trigger


def commit(s: State, cfg: Config) -> Iterator[Step]:
    """Compare-and-set ``K^v -> (v+1, g)`` once every required receiver ACKed."""
    for c, cv in acting(s, cfg):
        a = s.attempt(cv.attempt) if cv.attempt != NONE else None
        if cv.aphase is _A.FLUSHING and a is not None and a.required <= a.acks:
            b = Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.COMMIT))
            b.attempt(cv.attempt, cas=Cas.IN_FLIGHT)
            yield b.step(f"commit(c{c})")


def compare_and_set(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane executes a compare-and-set that reached it."""
    for tau, a in enumerate(s.attempts, start=1):
        if a.cas is not Cas.IN_FLIGHT:
            continue
        b = Builder(s)
        changes: dict[str, object] = {}
        if a.coord != s.epoch:
            reply = Reply.CONFLICT  # a replaced coordinator's commit raises conflict
        elif a.obsolete or a.expired:
            reply = Reply.FAILED if s.record == NONE else Reply.CONFLICT
        elif s.record == NONE:
            reply = Reply.SUCCEEDED
            changes = {"record": tau, "commit_epoch": s.epoch}
        else:
            reply = Reply.CONFLICT
        b.attempt(tau, cas=Cas.DONE, reply=reply)
        yield b.step(f"compare_and_set(t{tau})", **changes)


def commit_succeeded(s: State, cfg: Config) -> Iterator[Step]:
    """The record names ``(v+1, g)`` of the coordinator's attempt (reply or read_commit)."""
    for c, cv in acting(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = Builder(s)
        if (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.SUCCEEDED) or (
            cv.aphase is _A.RESOLVING and s.record == tau
        ):
            b.coord(
                c,
                aphase=b.go(cv.aphase, _X.COMMIT_SUCCEEDED),
                tphase=b.go(cv.tphase, _X.COMMIT_SUCCEEDED),
            )
        elif cv.tphase is _T.RESOLVING and s.record == tau:
            b.coord(c, tphase=b.go(cv.tphase, _X.COMMIT_SUCCEEDED))
        else:
            continue
        yield b.step(f"commit_succeeded(c{c})")


def commit_failed(s: State, cfg: Config) -> Iterator[Step]:
    """The record still holds ``K^v`` and no commit of the attempt can change it."""
    for c, cv in acting(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = Builder(s)
        if (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.FAILED) or (
            cv.aphase is _A.RESOLVING and s.record == NONE
        ):
            b.coord(
                c,
                aphase=b.go(cv.aphase, _X.COMMIT_FAILED),
                tphase=b.go(cv.tphase, _X.COMMIT_FAILED),
                overwrite=True,
            )
        elif cv.tphase is _T.RESOLVING and s.record == NONE:
            b.coord(c, tphase=b.go(cv.tphase, _X.COMMIT_FAILED), overwrite=True)
        else:
            continue
        yield b.step(f"commit_failed(c{c})")


def commit_unknown(s: State, cfg: Config) -> Iterator[Step]:
    """The coordinator got no reply: the request is still in flight or its reply was lost."""
    for c, cv in acting(s, cfg):
        if cv.aphase is _A.COMMITTING and (
            s.attempt(cv.attempt).cas is Cas.IN_FLIGHT or s.attempt(cv.attempt).reply is Reply.LOST
        ):
            b = Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.COMMIT_UNKNOWN))
            yield b.step(f"commit_unknown(c{c})")


def read_commit(s: State, cfg: Config) -> Iterator[Step]:
    """Read the record once no commit of the attempt can change it (deadline or obsolete)."""
    for c, cv in acting(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = Builder(s)
        if cv.aphase is _A.UNKNOWN and (s.attempt(tau).expired or s.attempt(tau).obsolete):
            b.coord(c, aphase=b.go(cv.aphase, _X.READ_COMMIT))
        elif cv.tphase is _T.TAKING_OVER and cv.aphase is _A.STOPPING and cv.stopped:
            b.coord(c, tphase=b.go(cv.tphase, _X.READ_COMMIT))
        else:
            continue
        yield b.step(f"read_commit(c{c})")


def conflict(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane raises conflict: this coordinator was replaced or lost the race."""
    for c, cv in enumerate(s.coords, 1):
        if not cv.started:  # every started coordinator, replaced ones too
            continue
        tau = cv.attempt
        lost_race = tau != NONE and (
            (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.CONFLICT)
            or (cv.aphase is _A.RESOLVING and s.record not in (NONE, tau))
            or (cv.tphase is _T.RESOLVING and s.record not in (NONE, tau))
        )
        if not (lost_race or s.epoch != c) or (cv.tphase, _X.CONFLICT) not in NEXT:
            continue
        b = Builder(s)
        b.coord(c, tphase=b.go(cv.tphase, _X.CONFLICT))
        if b.may(cv.aphase, _X.CONFLICT):
            b.coord(c, aphase=b.go(cv.aphase, _X.CONFLICT))
        yield b.step(f"conflict(c{c})")
