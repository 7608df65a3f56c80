"""Events: what the engine feeds into the protocol cores.

Events are facts that already happened -- a reply arrived, a timer expired, a payload was
decoded.  The engine delivers replies from endpoints to the coordinator as the events that
the endpoints' :class:`~dcr.protocol.commands.Notify` commands carry.  Time only ever arrives
as :class:`DeadlineExpired`; the cores never read a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol.types import AttemptInfo, CommitOutcome, CommitRecord, PayloadKey, Stage

__all__ = [
    "Acked",
    "AttemptFailed",
    "BaselineUpdated",
    "BaselineWritten",
    "BucketBuilt",
    "CleanupRequested",
    "CommitRead",
    "CommitRecordRead",
    "CommitReplied",
    "Conflict",
    "CoordinatorEvent",
    "DeadlineExpired",
    "DenseRefitDone",
    "FlushRequested",
    "GateClosed",
    "MarkObsoleteRequested",
    "ObsoleteMarked",
    "OpenApplyRequested",
    "OperatorAbort",
    "OwnerEvent",
    "PayloadArrived",
    "PayloadDecoded",
    "PayloadSent",
    "PayloadsApplied",
    "PrepareAccepted",
    "PrepareRejected",
    "PrepareRequested",
    "ReceiverEvent",
    "ReceiverReady",
    "Registered",
    "ReopenGateRequested",
    "RequestsDrained",
    "Retired",
    "SendsDone",
    "Staged",
    "StartTransition",
    "StopAndWaitRequested",
    "Stopped",
    "StreamingRequested",
    "Synchronized",
    "TakeOver",
    "WaitForRequestsRequested",
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
class PrepareAccepted:
    """An endpoint bound the attempt (its metadata and loader classification checks passed)."""

    attempt: int
    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareRejected:
    """An endpoint's prepare check failed (``reject`` in Algorithm B.2)."""

    attempt: int
    endpoint: str
    check: str
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFailed:
    """An endpoint reports that the attempt failed (a ``RemoteProtocolError``-class outcome).

    ``check`` names what failed: ``digest``, ``conflicting-duplicate``, ``declared-order``,
    ``apply``, ``encode``, ``transport``, ``post-apply``, ...
    """

    attempt: int
    endpoint: str
    check: str
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendsDone:
    """An owner sent its last payload; ``payload_count`` is its declared sent list ``0..n-1``."""

    attempt: int
    owner: str
    payload_count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Staged:
    """Asynchronous RL: a receiver holds every payload up to each owner's final one.

    ``counts`` lists ``(owner, payload count)`` in owner order; the coordinator compares it
    with the owners' declared sent lists before it closes the gate (arrival check).
    """

    attempt: int
    receiver: str
    counts: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GateClosed:
    """A receiver closed its request gate and its in-flight requests finished."""

    attempt: int
    receiver: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    """Completion ACK: the receiver drained its queue, synchronized and ran post-apply checks.

    ``applied`` lists ``(owner, payload count)`` the receiver applied, in owner order.
    """

    attempt: int
    receiver: str
    applied: tuple[tuple[str, int], ...]
    post_apply_checked: bool


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
class Stopped:
    """An endpoint stopped the attempt and its pending writes finished.

    ``dirty`` is a receiver's report that writes of some attempt landed since it last held
    a committed record: after an abort it needs a dense refit before its gate reopens.
    """

    attempt: int
    endpoint: str
    dirty: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Retired:
    """An endpoint's process and pending writes are confirmed unable to resume."""

    attempt: int
    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineUpdated:
    """An owner finished the in-place baseline update named by ``record``."""

    owner: str
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverReady:
    """A receiver restored ``record`` by a dense refit and prewarm; it may join at prepare."""

    receiver: str
    record: CommitRecord


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


CoordinatorEvent = (
    StartTransition | TakeOver | Registered | PrepareAccepted | PrepareRejected | AttemptFailed
    | SendsDone | Staged | GateClosed | Acked | CommitReplied | CommitRead | ObsoleteMarked
    | Stopped | Retired | BaselineUpdated | ReceiverReady | DeadlineExpired | Conflict
    | OperatorAbort
)  # fmt: skip

# --- endpoints: control calls from the coordinator ------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareRequested:
    """prepare reached this endpoint; ``rejection`` is the failed metadata/loader check, if any."""

    info: AttemptInfo
    rejection: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamingRequested:
    """Owners: start building and sending buckets for the attempt."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitForRequestsRequested:
    """Receivers: close the request gate and wait for in-flight requests."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenApplyRequested:
    """Receivers: the attempt's payloads may be applied."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushRequested:
    """Owners close their sends; receivers check arrival against ``expected`` and drain."""

    attempt: int
    expected: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkObsoleteRequested:
    """Ignore the attempt's later payloads and ``open_apply``."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAndWaitRequested:
    """Stop the attempt and report once its pending writes finished."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CleanupRequested:
    """Release the attempt's payloads and records."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReopenGateRequested:
    """Receivers: drop the KV cache and reopen the gate; ``record`` is the committed version."""

    attempt: int
    epoch: int
    record: CommitRecord


# --- owners: data plane and commit record -------------------------------------------------


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
class CommitRecordRead:
    """The owner read the commit record (after the coordinator asked it to)."""

    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineWritten:
    """The engine finished updating trackers and residual baseline to ``record``."""

    record: CommitRecord
    failure: str | None = None


OwnerEvent = (
    PrepareRequested | StreamingRequested | FlushRequested | MarkObsoleteRequested
    | StopAndWaitRequested | CleanupRequested | BucketBuilt | PayloadSent | CommitRecordRead
    | BaselineWritten
)  # fmt: skip

# --- receivers: data plane ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadArrived:
    """A payload arrived; the engine already ran the reception checks on its bytes.

    ``digest`` is the digest of the received compressed body; ``rejection`` names the failed
    check (digest, magic, schema, names, shapes, dtypes, classification) or is ``None``.
    """

    attempt: int
    owner: str
    payload_id: int
    digest: bytes
    final: bool
    rejection: str | None = None


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
    """Device work of the attempt finished (after the queue drained)."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseRefitDone:
    """The engine restored ``record`` by a dense load through the native loader and prewarmed."""

    record: CommitRecord


ReceiverEvent = (
    PrepareRequested | WaitForRequestsRequested | OpenApplyRequested | FlushRequested
    | MarkObsoleteRequested | StopAndWaitRequested | CleanupRequested | ReopenGateRequested
    | PayloadArrived | PayloadDecoded | PayloadsApplied | RequestsDrained | Synchronized
    | DenseRefitDone
)  # fmt: skip
