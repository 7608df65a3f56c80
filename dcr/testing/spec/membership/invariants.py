"""Safety invariants of runs of several transitions (``models/membership.tla``, same names).

The one-transition invariants of ``models/refit.tla`` carry over (with versions beyond
``v+1``), and two concern membership:

* ``MembersHoldBase`` -- (a) a receiver process takes part in a mixed-mode attempt (its
  prepare accepted, the attempt admitted) only if its storage holds exactly the base record:
  a joined, restarted or restored receiver holds the committed bits before it takes part;
* ``JobsOfTheActiveCoordinator`` -- (b) dense-job ids increase over the whole run (each
  coordinator issues them above every attempt id of its epoch, and every run claims a newer
  epoch), and the active coordinator tracks -- so checks arrival of, sends again, releases
  and reopens gates by -- only jobs it issued, all above every id a replaced coordinator
  issued.  The stronger "no job of an older epoch is acted on once a newer epoch is active"
  does not hold (see :data:`STRONG_JOB_EPOCHS`): a coordinator's run claims a new epoch while
  its jobs continue under the old one until the run ends, and a receiver that has not yet
  seen a call of the newer coordinator still applies a replaced coordinator's job -- which
  restores exactly a committed version (``CommittedReceiversExact``).
"""

from __future__ import annotations

from collections.abc import Callable

from dcr.protocol.lifecycle import ReceiverPhase
from dcr.testing.spec.membership.state import BAD, State

__all__ = ["INVARIANTS", "STRONG_JOB_EPOCHS", "violations"]

_R = ReceiverPhase

Invariant = Callable[[State], str | None]


def members_hold_base(s: State) -> str | None:
    run = s.run
    if run is None or not run.attempt or run.overwrite:
        return None
    for r, inc in sorted(run.bound):
        rx = s.receivers[r]
        if rx.inc == inc and r not in run.applied and rx.storage != run.base:
            return (
                f"receiver {r} takes part in mixed-mode attempt {run.attempt:#x} from "
                f"version {run.base} but its storage holds {rx.storage}"
            )
    return None


def _epoch_of(job: int) -> int:
    return job >> 32


def jobs_of_the_active_coordinator(s: State) -> str | None:
    for r, job in enumerate(s.core.jobs):
        if job is None:
            continue
        e = _epoch_of(job.job)
        if not (e << 32) | (1 << 31) < job.job < (e + 1) << 32:
            return f"receiver {r}'s job {job.job:#x} is not a dense id of epoch {e}"
        if e > s.core.epoch:
            return f"receiver {r}'s job {job.job:#x} is of epoch {e}, after {s.core.epoch}"
        if e <= s.stale_epoch:
            return (
                f"the active coordinator tracks job {job.job:#x} of receiver {r}, of epoch "
                f"{e}: a replaced coordinator issued jobs under epoch {s.stale_epoch}"
            )
    return None


def xor_applied_once(s: State) -> str | None:
    for r, rx in enumerate(s.receivers):
        if rx.storage == BAD:
            return f"receiver {r} holds an XOR entry applied to the wrong base"
    return None


def committed_receivers_exact(s: State) -> str | None:
    for r, rx in enumerate(s.receivers):
        exact = not (rx.foreign or rx.dirty)
        if rx.phase in (_R.READY, _R.REFITTED) and exact and rx.storage != rx.held:
            return f"receiver {r} is {rx.phase.value} at version {rx.held} but holds {rx.storage}"
        if rx.phase is _R.ACKED and rx.storage != rx.acked:
            return f"receiver {r} acknowledged version {rx.acked} but holds {rx.storage}"
    return None


def gate_serves_committed(s: State) -> str | None:
    for r, rx in enumerate(s.receivers):
        if not rx.gate:
            continue
        if not (rx.storage == rx.held and 0 <= rx.held <= s.record):
            return (
                f"receiver {r} serves storage {rx.storage} (claims {rx.held}) with record "
                f"{s.record}"
            )
        if rx.dense is not None and rx.dense.record != rx.held:
            return (
                f"receiver {r} serves version {rx.held} while dense job {rx.dense.job:#x} of "
                f"version {rx.dense.record} runs (its payloads land while it serves)"
            )
    return None


def commit_requires_all_acks(s: State) -> str | None:
    for v, c in enumerate(s.commits, start=1):
        if c.missing:
            return f"version {v} committed without ACKs from {sorted(c.missing)}"
    return None


def replaced_never_commits(s: State) -> str | None:
    for v, c in enumerate(s.commits, start=1):
        if c.epoch != c.lease:
            return f"version {v} committed by coordinator {c.epoch} while {c.lease} was active"
    return None


def baseline_matches_commit(s: State) -> str | None:
    for o, ow in enumerate(s.owners):
        if not s.record - 1 <= ow.baseline <= s.record:
            return f"owner {o} holds baseline {ow.baseline} with record {s.record}"
    run = s.run
    if (
        run is not None
        and run.attempt
        and not run.committed
        and any(ow.baseline != run.base for ow in s.owners)
    ):
        return f"attempt {run.attempt:#x} from {run.base} runs on another baseline"
    return None


INVARIANTS: dict[str, Invariant] = {
    "MembersHoldBase": members_hold_base,
    "JobsOfTheActiveCoordinator": jobs_of_the_active_coordinator,
    "XorAppliedOnce": xor_applied_once,
    "CommittedReceiversExact": committed_receivers_exact,
    "GateServesCommitted": gate_serves_committed,
    "CommitRequiresAllAcks": commit_requires_all_acks,
    "ReplacedNeverCommits": replaced_never_commits,
    "BaselineMatchesCommit": baseline_matches_commit,
}
"""Invariant name (as in ``models/membership.tla``) -> check."""


def no_job_of_an_older_epoch(s: State) -> str | None:
    """The strong form of (b), which the protocol does not promise: no dense job of an epoch
    older than the active one is tracked, in flight or being restored."""
    jobs = [j.job for j in s.core.jobs if j is not None]
    jobs += [c.job for c in s.to_receivers]
    jobs += [rx.dense.job for rx in s.receivers if rx.dense is not None]
    old = [j for j in jobs if _epoch_of(j) < s.lease]
    return f"job {old[0]:#x} of epoch {_epoch_of(old[0])} under epoch {s.lease}" if old else None


STRONG_JOB_EPOCHS: dict[str, Invariant] = {"NoJobOfAnOlderEpoch": no_job_of_an_older_epoch}
"""The strong form of (b): the search finds a counterexample (tests/model)."""


def violations(s: State) -> list[tuple[str, str]]:
    return [(name, m) for name, check in INVARIANTS.items() if (m := check(s)) is not None]
