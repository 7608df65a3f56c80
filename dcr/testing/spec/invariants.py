"""Safety invariants of the refit protocol, shared by the model checker and the stateful tests.

Each invariant takes a :class:`~dcr.testing.spec.state.State` and returns ``None`` when it
holds, or a sentence saying how it is violated.  The names match the invariants in
``models/refit.tla``.
"""

from __future__ import annotations

from collections.abc import Callable

from dcr.protocol.lifecycle import ReceiverPhase, TransitionPhase
from dcr.testing.spec.state import BAD, EMPTY, LOST, NONE, V1, State

__all__ = ["INVARIANTS", "Invariant", "violations"]

Invariant = Callable[[State], str | None]


def commit_requires_all_acks(s: State) -> str | None:
    """A commit happens only after every required receiver ACKed that same attempt (G5)."""
    if s.record == NONE:
        return None
    a = s.attempt(s.record)
    missing = a.required - a.acks
    if missing:
        return f"attempt {s.record} committed without ACKs from {sorted(missing)}"
    return None


def committed_receivers_exact(s: State) -> str | None:
    """Every receiver that holds a committed version holds exactly it, with no mixture (G1).

    That is each required receiver of the committed attempt that is still the same process,
    and each receiver that is ready or refitted at a version it claims.
    """
    if s.record != NONE:
        for r, inc in sorted(s.attempt(s.record).required):
            rx = s.receivers[r]
            if rx.inc == inc and any(v != V1 for v in rx.storage):
                return f"receiver {r} ACKed committed attempt {s.record} but holds {rx.storage}"
    for r, rx in enumerate(s.receivers):
        if rx.phase in (ReceiverPhase.READY, ReceiverPhase.REFITTED) and any(
            v != rx.held for v in rx.storage
        ):
            return f"receiver {r} is {rx.phase.value} at version {rx.held} but holds {rx.storage}"
    return None


def baseline_matches_commit(s: State) -> str | None:
    """Owners update the baseline only after the commit, and before the transition ends.

    So the baseline the next delta uses equals the committed version (paper §6.3).  The
    receivers' gates may reopen before: they serve the committed record, which the owners'
    baselines do not change.
    """
    for o, ow in enumerate(s.owners):
        if ow.baseline == V1 and s.record == NONE:
            return f"owner {o} updated its baseline but the record still holds K^v"
    ended = any(
        c.tphase in (TransitionPhase.REOPENING, TransitionPhase.COMMITTED) for c in s.coords
    )
    if ended and any(ow.baseline != s.record_version for ow in s.owners):
        return "the transition ended before every owner updated its baseline"
    return None


def xor_applied_once(s: State) -> str | None:
    """An XOR entry is applied at most once, and only to the base it was computed from."""
    for r, rx in enumerate(s.receivers):
        if BAD in rx.storage:
            return f"receiver {r} holds an XOR entry applied to the wrong base: {rx.storage}"
    return None


def replaced_never_commits(s: State) -> str | None:
    """Only the active coordinator's commit can change the record (paper App. B.2)."""
    if s.record != NONE and s.commit_epoch != s.attempt(s.record).coord:
        return (
            f"attempt {s.record} of coordinator {s.attempt(s.record).coord} committed while "
            f"coordinator {s.commit_epoch} was active"
        )
    return None


def gate_closed_on_mixture(s: State) -> str | None:
    """An open gate serves exactly the committed version, with a KV cache of those weights."""
    for r, rx in enumerate(s.receivers):
        if not rx.gate_open:
            continue
        values = set(rx.storage)
        if len(values) != 1 or values & {BAD, LOST}:
            return f"receiver {r} serves requests while it holds a mixture {rx.storage}"
        (value,) = values
        if value != s.record_version:
            return f"receiver {r} serves version {value} but the record holds {s.record_version}"
        if rx.kv not in (EMPTY, value):
            return f"receiver {r} serves with a KV cache of version {rx.kv} on version {value}"
    return None


INVARIANTS: dict[str, Invariant] = {
    "CommitRequiresAllAcks": commit_requires_all_acks,
    "CommittedReceiversExact": committed_receivers_exact,
    "BaselineMatchesCommit": baseline_matches_commit,
    "XorAppliedOnce": xor_applied_once,
    "ReplacedNeverCommits": replaced_never_commits,
    "GateClosedOnMixture": gate_closed_on_mixture,
}
"""Invariant name (as in ``models/refit.tla``) -> check."""


def violations(s: State) -> list[tuple[str, str]]:
    """``(invariant name, message)`` for every invariant ``s`` violates."""
    return [(name, msg) for name, check in INVARIANTS.items() if (msg := check(s)) is not None]
