"""Phases, triggers and the one edge table of the refit protocol (paper App. B).

Four lifecycles share one trigger vocabulary:

* :class:`TransitionPhase` -- the coordinator's view of one transition ``v -> v+1``
  (Algorithm B.2: admission, overwrite retries, takeover, commit, end of the transition);
* :class:`AttemptPhase` -- the coordinator's view of one attempt ``tau`` (Algorithm B.1 plus
  the commit and the stop path of Algorithm B.2);
* :class:`OwnerPhase` and :class:`ReceiverPhase` -- what an owner and a receiver do for the
  attempt they were last prepared for.

:data:`EDGES` is the single table of legal ``(source, trigger, dest)`` triples.  The state
machines in :mod:`dcr.protocol.machine` are built from it, the diagram in ``docs/protocol.md``
is drawn from it, and the test suite's model checker (the Python mirror of the TLA+
specification) moves its phases through it.  The TLA+ specification in ``models/refit.tla``
names one action per trigger.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Generic, NamedTuple, TypeVar

__all__ = [
    "EDGES",
    "INITIAL_PHASES",
    "AnyEdge",
    "LIFECYCLES",
    "AttemptPhase",
    "Edge",
    "OwnerPhase",
    "Phase",
    "ReceiverPhase",
    "TransitionPhase",
    "Trigger",
    "edges_of",
    "initial_phase",
    "terminal_phases",
]


class _Members(enum.Enum):
    """An enum whose members hash by identity, in C: members are singletons and compare by
    identity, and ``Enum``'s own hash (of the member's name) runs in Python, a cost every
    edge-table lookup pays, and the model checker's searches millions of times."""

    __hash__ = object.__hash__


class Trigger(_Members):
    """Protocol operations and outcomes; each is one action of the TLA+ specification."""

    PREPARE = "prepare"
    """Start an attempt: bind ``tau``, ``g``, the mode and the required receivers."""
    REJECT = "reject"
    """A prepare check failed before admission; the transition ends with ``v`` committed."""
    SEND = "send"
    """Owners stream: the coordinator starts them, an owner emits one bucket's payload."""
    INGEST = "ingest"
    """A receiver accepts a payload of its active attempt (validated, not a duplicate)."""
    WAIT_FOR_REQUESTS = "wait_for_requests"
    """Close the request gate and wait until in-flight requests finish."""
    OPEN_APPLY = "open_apply"
    """Receivers may apply the attempt's payloads."""
    APPLY = "apply"
    """A receiver applies the next payloads in the attempt's declared order."""
    FLUSH = "flush"
    """Close sends, check arrival, drain the queues, collect completion ACKs."""
    ACK = "ack"
    """A receiver reports completion: drained, synchronized, post-apply checks passed."""
    COMMIT = "commit"
    """Compare-and-set ``K^v -> (v+1, g)`` with a deadline."""
    COMMIT_SUCCEEDED = "commit_succeeded"
    """The commit record names ``(v+1, g)`` of this attempt."""
    COMMIT_FAILED = "commit_failed"
    """The commit record still holds ``K^v`` and no commit of the attempt can change it."""
    COMMIT_UNKNOWN = "commit_unknown"
    """The reply to the compare-and-set was lost; resolve with ``read_commit``."""
    CONFLICT = "conflict"
    """Another coordinator is active or committed: stand down, leave the gate alone."""
    READ_COMMIT = "read_commit"
    """Read the commit record once no commit of the attempt can change it."""
    FAIL = "fail"
    """The attempt failed (timeout, bad payload, transport error, reject after admission)."""
    MARK_OBSOLETE = "mark_obsolete"
    """Endpoints ignore the attempt's later payloads; the control plane refuses its commit."""
    STOP_AND_WAIT = "stop_and_wait"
    """Stop delivery and wait until the attempt's pending writes can no longer land."""
    CLEANUP = "cleanup"
    """Release the attempt's payloads and records; ``B^v`` stays unchanged."""
    BASELINE_UPDATE = "baseline_update"
    """An owner read ``(v+1, g)`` and updates its trackers and residual baseline in place."""
    REOPEN_GATE = "reopen_gate"
    """Receivers drop their KV caches and reopen the request gate."""
    TAKE_OVER = "take_over"
    """A new coordinator adopts the attempt of the coordinator it replaced."""
    ABORT = "abort"
    """The operator ends the transition; a closed gate stays closed until a dense refit."""
    DENSE_REFIT = "dense_refit"
    """A receiver restores the committed version by a dense load (joining, or after abort)."""


class TransitionPhase(_Members):
    """The coordinator's view of one transition (Algorithm B.2)."""

    IDLE = "idle"
    ADMITTING = "admitting"
    """The first prepare (mixed mode) is in flight; nothing is admitted yet."""
    READMITTING = "readmitting"
    """A failure before admission; the failed attempt is stopped, then prepare is retried."""
    RUNNING = "running"
    """Admitted: an attempt runs (retries use overwrite mode)."""
    RECOVERING = "recovering"
    """A failure after admission: the attempt is stopped before an overwrite retry."""
    TAKING_OVER = "taking_over"
    """After failover: the old attempt is marked obsolete and drained."""
    RESOLVING = "resolving"
    """After failover: ``read_commit`` decides whether the old attempt committed."""
    FINISHING = "finishing"
    """Committed: waiting until every owner reports its baseline update."""
    REOPENING = "reopening"
    """Baselines are updated and the attempt is cleaned up; the gate reopens next."""
    REJECTING = "rejecting"
    """The first prepare was rejected; its attempt is stopped before the transition ends."""
    ABORTING = "aborting"
    """The operator aborted; the attempt is stopped and cleaned up."""
    REFITTING = "refitting"
    """Aborted: the gate stays closed until dense refits restore the committed version."""
    COMMITTED = "committed"
    """``v+1`` is committed, baselines are updated and the gate is open."""
    REJECTED = "rejected"
    """The first prepare was rejected; ``v`` stays committed."""
    ABORTED = "aborted"
    """Aborted and every receiver that applied anything was dense-refitted."""
    STOOD_DOWN = "stood_down"
    """Replaced by another coordinator; this one never commits or touches the gate again."""


class AttemptPhase(_Members):
    """The coordinator's view of one attempt (Algorithm B.1 and the stop path of B.2)."""

    PLANNED = "planned"
    PREPARING = "preparing"
    STREAMING = "streaming"
    GATING = "gating"
    APPLYING = "applying"
    FLUSHING = "flushing"
    COMMITTING = "committing"
    UNKNOWN = "unknown"
    RESOLVING = "resolving"
    COMMITTED = "committed"
    FAILED = "failed"
    OBSOLETE = "obsolete"
    STOPPING = "stopping"
    CLEANED = "cleaned"
    ABANDONED = "abandoned"


class OwnerPhase(_Members):
    """An owner's view of the attempt it was last prepared for."""

    IDLE = "idle"
    """No attempt; the baseline holds the committed version."""
    PREPARED = "prepared"
    SENDING = "sending"
    SENT = "sent"
    """Sends are closed and the sent list is declared."""
    OBSOLETE = "obsolete"
    STOPPED = "stopped"
    UPDATED = "updated"
    """The commit record named ``(v+1, g)``; trackers and residual baseline were updated."""


class ReceiverPhase(_Members):
    """A receiver's view of the attempt it was last prepared for."""

    JOINING = "joining"
    """New or restarted: storage is unknown until a dense refit."""
    READY = "ready"
    """Holds the committed version and serves requests."""
    REFITTED = "refitted"
    """Restored a committed version by a dense refit; joins at the next prepare."""
    PREPARED = "prepared"
    GATED = "gated"
    APPLYING = "applying"
    FLUSHING = "flushing"
    ACKED = "acked"
    FAILED = "failed"
    OBSOLETE = "obsolete"
    STOPPED = "stopped"
    CLEANED = "cleaned"
    """The attempt is released; storage may hold a mixture until an overwrite retry."""


Phase = TransitionPhase | AttemptPhase | OwnerPhase | ReceiverPhase
P = TypeVar("P", TransitionPhase, AttemptPhase, OwnerPhase, ReceiverPhase)


class Edge(NamedTuple, Generic[P]):
    """One legal step of a lifecycle: ``trigger`` moves ``source`` to ``dest``."""

    source: P
    trigger: Trigger
    dest: P


def _each(sources: Iterable[P], trigger: Trigger, dest: P) -> tuple[Edge[P], ...]:
    return tuple(Edge(s, trigger, dest) for s in sources)


_T = TransitionPhase
_A = AttemptPhase
_O = OwnerPhase
_R = ReceiverPhase
_X = Trigger

_TRANSITION_LIVE = (
    _T.ADMITTING, _T.READMITTING, _T.RUNNING, _T.RECOVERING, _T.TAKING_OVER, _T.RESOLVING,
    _T.FINISHING, _T.REOPENING, _T.REJECTING, _T.ABORTING, _T.REFITTING,
)  # fmt: skip
_ATTEMPT_LIVE = (
    _A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING, _A.COMMITTING,
    _A.UNKNOWN, _A.RESOLVING, _A.COMMITTED, _A.FAILED, _A.OBSOLETE, _A.STOPPING,
)  # fmt: skip
_ATTEMPT_RUNNING = (_A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING)
_RECEIVER_RUNNING = (_R.PREPARED, _R.GATED, _R.APPLYING, _R.FLUSHING)

AnyEdge = Edge[TransitionPhase] | Edge[AttemptPhase] | Edge[OwnerPhase] | Edge[ReceiverPhase]

EDGES: tuple[AnyEdge, ...] = (
    # -- transition (Algorithm B.2) --------------------------------------------------------
    Edge(_T.IDLE, _X.PREPARE, _T.ADMITTING),
    Edge(_T.IDLE, _X.TAKE_OVER, _T.TAKING_OVER),
    Edge(_T.ADMITTING, _X.SEND, _T.RUNNING),  # every prepare accepted: admitted
    Edge(_T.ADMITTING, _X.REJECT, _T.REJECTING),
    Edge(_T.ADMITTING, _X.FAIL, _T.READMITTING),
    Edge(_T.READMITTING, _X.PREPARE, _T.ADMITTING),  # retried in mixed mode
    Edge(_T.RUNNING, _X.FAIL, _T.RECOVERING),
    Edge(_T.RUNNING, _X.COMMIT_FAILED, _T.RECOVERING),
    Edge(_T.RUNNING, _X.COMMIT_SUCCEEDED, _T.FINISHING),
    Edge(_T.RECOVERING, _X.PREPARE, _T.RUNNING),  # overwrite retry
    Edge(_T.TAKING_OVER, _X.READ_COMMIT, _T.RESOLVING),
    Edge(_T.RESOLVING, _X.COMMIT_SUCCEEDED, _T.FINISHING),  # the old attempt committed
    Edge(_T.RESOLVING, _X.COMMIT_FAILED, _T.RECOVERING),
    Edge(_T.FINISHING, _X.BASELINE_UPDATE, _T.FINISHING),
    Edge(_T.FINISHING, _X.CLEANUP, _T.REOPENING),
    Edge(_T.REOPENING, _X.REOPEN_GATE, _T.COMMITTED),
    Edge(_T.REJECTING, _X.CLEANUP, _T.REJECTED),
    *_each((_T.ADMITTING, _T.READMITTING, _T.RUNNING, _T.RECOVERING), _X.ABORT, _T.ABORTING),
    Edge(_T.ABORTING, _X.CLEANUP, _T.REFITTING),
    Edge(_T.REFITTING, _X.DENSE_REFIT, _T.REFITTING),
    Edge(_T.REFITTING, _X.REOPEN_GATE, _T.ABORTED),
    *_each(_TRANSITION_LIVE, _X.CONFLICT, _T.STOOD_DOWN),
    # -- attempt, coordinator's view (Algorithm B.1 and B.2) -------------------------------
    Edge(_A.PLANNED, _X.PREPARE, _A.PREPARING),
    Edge(_A.PLANNED, _X.TAKE_OVER, _A.FAILED),  # the replaced coordinator's attempt
    Edge(_A.PREPARING, _X.SEND, _A.STREAMING),
    Edge(_A.PREPARING, _X.REJECT, _A.FAILED),
    Edge(_A.STREAMING, _X.WAIT_FOR_REQUESTS, _A.GATING),
    Edge(_A.GATING, _X.OPEN_APPLY, _A.APPLYING),
    Edge(_A.APPLYING, _X.FLUSH, _A.FLUSHING),
    Edge(_A.FLUSHING, _X.COMMIT, _A.COMMITTING),
    Edge(_A.COMMITTING, _X.COMMIT_SUCCEEDED, _A.COMMITTED),
    Edge(_A.COMMITTING, _X.COMMIT_FAILED, _A.FAILED),
    Edge(_A.COMMITTING, _X.COMMIT_UNKNOWN, _A.UNKNOWN),
    Edge(_A.UNKNOWN, _X.READ_COMMIT, _A.RESOLVING),
    Edge(_A.RESOLVING, _X.COMMIT_SUCCEEDED, _A.COMMITTED),
    Edge(_A.RESOLVING, _X.COMMIT_FAILED, _A.FAILED),
    *_each(_ATTEMPT_RUNNING, _X.FAIL, _A.FAILED),
    Edge(_A.FAILED, _X.MARK_OBSOLETE, _A.OBSOLETE),
    Edge(_A.OBSOLETE, _X.STOP_AND_WAIT, _A.STOPPING),
    Edge(_A.STOPPING, _X.CLEANUP, _A.CLEANED),
    Edge(_A.COMMITTED, _X.CLEANUP, _A.CLEANED),
    *_each(_ATTEMPT_LIVE, _X.CONFLICT, _A.ABANDONED),
    # -- owner ----------------------------------------------------------------------------
    Edge(_O.IDLE, _X.PREPARE, _O.PREPARED),
    Edge(_O.PREPARED, _X.SEND, _O.SENDING),
    Edge(_O.SENDING, _X.SEND, _O.SENDING),
    Edge(_O.SENDING, _X.FLUSH, _O.SENT),
    *_each((_O.PREPARED, _O.SENDING, _O.SENT), _X.MARK_OBSOLETE, _O.OBSOLETE),
    Edge(_O.OBSOLETE, _X.STOP_AND_WAIT, _O.STOPPED),
    Edge(_O.STOPPED, _X.CLEANUP, _O.IDLE),
    *_each((_O.IDLE, _O.SENT, _O.OBSOLETE, _O.STOPPED, _O.UPDATED), _X.BASELINE_UPDATE, _O.UPDATED),
    Edge(_O.UPDATED, _X.CLEANUP, _O.IDLE),
    # -- receiver -------------------------------------------------------------------------
    *_each((_R.JOINING, _R.READY, _R.REFITTED, _R.CLEANED), _X.DENSE_REFIT, _R.REFITTED),
    *_each((_R.READY, _R.REFITTED, _R.CLEANED), _X.PREPARE, _R.PREPARED),
    *(Edge(p, _X.INGEST, p) for p in _RECEIVER_RUNNING),
    Edge(_R.PREPARED, _X.WAIT_FOR_REQUESTS, _R.GATED),
    Edge(_R.GATED, _X.OPEN_APPLY, _R.APPLYING),
    Edge(_R.APPLYING, _X.APPLY, _R.APPLYING),
    Edge(_R.FLUSHING, _X.APPLY, _R.FLUSHING),
    Edge(_R.APPLYING, _X.FLUSH, _R.FLUSHING),
    Edge(_R.FLUSHING, _X.ACK, _R.ACKED),
    *_each(_RECEIVER_RUNNING, _X.FAIL, _R.FAILED),
    *_each((*_RECEIVER_RUNNING, _R.ACKED, _R.FAILED), _X.MARK_OBSOLETE, _R.OBSOLETE),
    Edge(_R.OBSOLETE, _X.STOP_AND_WAIT, _R.STOPPED),
    *_each((_R.STOPPED, _R.ACKED), _X.CLEANUP, _R.CLEANED),
    *_each((_R.CLEANED, _R.REFITTED), _X.REOPEN_GATE, _R.READY),
)
"""Every legal step of every lifecycle; anything else raises :class:`LocalProtocolError`."""

LIFECYCLES: tuple[type[Phase], ...] = (TransitionPhase, AttemptPhase, OwnerPhase, ReceiverPhase)
"""The lifecycles in the order the documentation draws them."""

INITIAL_PHASES: dict[type[Phase], Phase] = {
    TransitionPhase: TransitionPhase.IDLE,
    AttemptPhase: AttemptPhase.PLANNED,
    OwnerPhase: OwnerPhase.IDLE,
    ReceiverPhase: ReceiverPhase.READY,
}
"""Where a fresh machine of each lifecycle starts (a restarted receiver starts JOINING)."""


def edges_of(lifecycle: type[P]) -> tuple[Edge[P], ...]:
    """The rows of :data:`EDGES` that belong to ``lifecycle``."""
    return tuple(e for e in EDGES if isinstance(e.source, lifecycle))


def initial_phase(lifecycle: type[P]) -> P:
    """Where a fresh machine of ``lifecycle`` starts (a restarted receiver starts JOINING)."""
    phase = INITIAL_PHASES[lifecycle]
    assert isinstance(phase, lifecycle)
    return phase


def terminal_phases(lifecycle: type[P]) -> frozenset[P]:
    """Phases of ``lifecycle`` that no edge leaves."""
    sources = {e.source for e in edges_of(lifecycle)}
    return frozenset(p for p in lifecycle if p not in sources)
