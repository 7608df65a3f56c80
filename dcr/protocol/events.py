"""Local events: facts the engine feeds into the protocol cores besides control messages.

A core's input is either a control message (:mod:`dcr.protocol.messages`: a call for an
endpoint, a reply for a coordinator) or one of these local facts -- a control-plane answer, a
timer that expired, a payload that arrived or was decoded, local work that finished.  Time only
ever arrives as :class:`DeadlineExpired`; the cores never read a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol import messages as msg
from dcr.protocol.proof import Proof
from dcr.protocol.types import AttemptInfo, CommitOutcome, CommitRecord, PayloadKey, Stage

__all__ = [
    "BaselineWritten",
    "BucketBuilt",
    "CandidateStaged",
    "CommitRead",
    "CommitRecordRead",
    "CommitReplied",
    "Conflict",
    "CoordinatorEvent",
    "DeadlineExpired",
    "DenseRefitDone",
    "DenseSent",
    "Departed",
    "ObsoleteMarked",
    "OperatorAbort",
    "OwnerEvent",
    "PayloadArrived",
    "PayloadDecoded",
    "PayloadReceived",
    "PayloadSent",
    "PayloadsApplied",
    "PrepareChecked",
    "ReceiverEvent",
    "Registered",
    "RequestsDrained",
    "StartTransition",
    "Synchronized",
    "TakeOver",
]


# --- coordinator ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class StartTransition:
    """Begin the transition ``K^v -> v+1`` in mixed mode (Algorithm B.2, line 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeOver:
    """This coordinator replaced another one (the engine registered its epoch first).

    ``old`` is the last attempt the control plane registered for the transition, or ``None``
    when the old coordinator never prepared one; then the transition starts afresh.
    """

    old: AttemptInfo | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    """The control plane accepted the prepare of ``attempt`` from the active coordinator."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitReplied:
    """The compare-and-set answered (``UNKNOWN`` when its reply was lost or the call failed)."""

    attempt: int
    outcome: CommitOutcome


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRead:
    """``read_commit`` returned the current commit record."""

    attempt: int
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class ObsoleteMarked:
    """The control plane recorded the attempt as obsolete; it refuses the attempt's commit."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlineExpired:
    """A timer armed by :class:`~dcr.protocol.commands.ArmDeadline` (or a commit) expired."""

    attempt: int
    stage: Stage


@dataclass(frozen=True, slots=True, kw_only=True)
class Conflict:
    """The control plane raised ``conflict``: another coordinator is active or committed."""

    attempt: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorAbort:
    """The operator aborts the transition (persistent failure, paper App. B.2)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Departed:
    """Receiver ``endpoint`` left the fleet: the coordinator has not heard from it over the
    control channel for longer than its bound, or its node was reported lost.

    It is no longer required: the membership core forgets its status (it is no longer a
    member, nor waited for as a joiner), and a transition core takes it out of the receivers
    the next attempt requires and retires it from the current attempt, which does not wait
    for it any more (as for :class:`~dcr.protocol.messages.Retired`; an attempt that still
    runs fails and is retried without it).  The stop-path and gate calls of that attempt
    still address it, so a receiver that was only out of reach finds its attempt cleaned up
    when it comes back.  A receiver that reports again (``EndpointStatus``) rejoins as one
    seen for the first time: fingerprinted before it takes part, restored by dense refit
    unless it holds the committed record.  The departure of an owner, or of a name that is
    not a member, changes nothing.
    """

    endpoint: str


CoordinatorEvent = (
    StartTransition | TakeOver | Registered | CommitReplied | CommitRead | ObsoleteMarked
    | DeadlineExpired | Conflict | OperatorAbort | Departed | msg.Reply
)  # fmt: skip

# --- endpoints: a prepare after the engine's own checks -----------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareChecked:
    """A :class:`~dcr.protocol.messages.Prepare` after the engine's metadata and loader
    classification checks; ``rejection`` names the failed check, or is ``None``.

    A bare ``Prepare`` is handled as ``PrepareChecked(info, rejection=None)``.
    """

    info: AttemptInfo
    rejection: str | None = None
    proof: Proof | None = None
    """The endpoint's answer to the prepare's proof request, computed by the engine."""


# --- owners: data plane and commit record -------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateStaged:
    """The trainer staged the next version on this owner (``staged``), or dropped it.

    A prepare that arrives while nothing is staged (a trainer restarted mid-transition is still
    computing its step) is held by the core, bounded by the coordinator's prepare deadline,
    and handled once the candidate is staged: it does not fail attempt after attempt.
    """

    staged: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketBuilt:
    """The engine built and encoded one bucket into payload ``payload_id``."""

    attempt: int
    payload_id: int
    final: bool
    """No records remain after this bucket."""
    failure: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadSent:
    """The transport accepted payload ``payload_id`` (``failure`` says why it did not)."""

    attempt: int
    payload_id: int
    failure: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseSent:
    """The engine sent (or failed to send) every payload of a dense-refit job."""

    job: int
    payloads: int
    failure: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecordRead:
    """The owner read the commit record (after the coordinator asked it to)."""

    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineWritten:
    """The engine finished updating trackers and residual baseline to ``record``."""

    record: CommitRecord
    failure: str | None = None


OwnerEvent = (
    msg.Call | PrepareChecked | CandidateStaged | BucketBuilt | PayloadSent | DenseSent
    | CommitRecordRead | BaselineWritten
)  # fmt: skip

# --- receivers: data plane ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadReceived:
    """The transport handed over a payload, unchecked; ``delivery`` numbers the copy.

    The core decides whether to check it now or park it unread (while its bounded queue
    back-pressures ingestion); a parked payload is not acknowledged to the transport, so the
    owners slow down instead of the receiver's memory growing (paper App. B.1).
    """

    delivery: int
    key: PayloadKey
    addressed: bool = False
    """Addressed to this receiver by name (a dense job's payload, which may overtake the
    job's call): one whose job has not started here yet is held, not dropped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadArrived:
    """The engine ran the reception checks on a delivery's bytes.

    ``digest`` is the digest of the received compressed body; ``rejection`` names the failed
    check (digest, magic, schema, names, shapes, dtypes, classification) or is ``None``, and
    ``detail`` says what the check found (the tensor, the shapes or dtypes that differ).
    """

    delivery: int
    key: PayloadKey
    digest: bytes
    final: bool
    rejection: str | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadDecoded:
    """The engine decoded a staged payload into the bounded queue."""

    key: PayloadKey
    failure: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadsApplied:
    """The engine applied a group of payloads through the native loader, in order."""

    attempt: int
    keys: tuple[PayloadKey, ...]
    failure: str | None = None
    post_apply_checked: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestsDrained:
    """The gate is closed and every in-flight request finished."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Synchronized:
    """Device work of the attempt (or dense-refit job) finished after the queue drained."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseRefitDone:
    """The engine restored ``record`` by a local dense load through the native loader."""

    record: CommitRecord


ReceiverEvent = (
    msg.Call | PrepareChecked | PayloadReceived | PayloadArrived | PayloadDecoded
    | PayloadsApplied | RequestsDrained | Synchronized | DenseRefitDone | DeadlineExpired
)  # fmt: skip
