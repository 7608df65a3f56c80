"""Commands: what the protocol cores ask the engine to do.

A core returns a list of commands for every event.  The engine executes them in list order
(each command may start asynchronous work; the core never waits for it) and reports what
happens as events.  Commands addressed to several endpoints (``owners``, ``receivers``) are
control calls the engine fans out; every reply comes back as its own event.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol.events import CoordinatorEvent
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey, Stage, TransitionOutcome

__all__ = [
    "Apply",
    "ArmDeadline",
    "BuildBucket",
    "Cleanup",
    "CloseGate",
    "Command",
    "CompareAndSet",
    "CoordinatorCommand",
    "Decode",
    "Discard",
    "Flush",
    "InvalidateKvCache",
    "MarkObsolete",
    "Notify",
    "OpenApply",
    "OpenGate",
    "OwnerCommand",
    "PauseIngest",
    "Prepare",
    "ReadCommit",
    "ReceiverCommand",
    "RegisterAttempt",
    "Release",
    "ReopenGate",
    "RequestBaselineUpdate",
    "RequestDenseRefit",
    "ResumeIngest",
    "SendPayload",
    "StagePayload",
    "StartStreaming",
    "StopAndWait",
    "StopStreaming",
    "Synchronize",
    "TransitionEnded",
    "UpdateBaseline",
    "WaitForRequests",
]

# --- coordinator ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterAttempt:
    """Control plane: accept the prepare of ``info`` only from the active coordinator and only
    while the record still equals ``info.base``; otherwise answer ``Conflict``."""

    info: AttemptInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    """Control call to every owner and every receiver in ``info.receivers``."""

    info: AttemptInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class StartStreaming:
    """Control call: owners start building and sending buckets."""

    attempt: int
    owners: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitForRequests:
    """Control call: receivers close the request gate and wait for in-flight requests."""

    attempt: int
    epoch: int
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenApply:
    """Control call: receivers may apply the attempt's payloads."""

    attempt: int
    epoch: int
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    """Control call: owners close their sends; receivers check arrival, drain, sync and ACK."""

    attempt: int
    owners: tuple[str, ...]
    receivers: frozenset[str]
    expected: tuple[tuple[str, int], ...]
    """``(owner, payload count)`` from every owner's declared sent list."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareAndSet:
    """Control plane: replace ``expected`` by ``new`` atomically.

    The control plane accepts it only from coordinator ``epoch``, only before the deadline
    ``deadline_s`` seconds from now, and never after the attempt was marked obsolete.  The
    engine arms the ``COMMIT`` deadline itself and reports the reply as ``CommitReplied``.
    """

    attempt: int
    epoch: int
    expected: CommitRecord
    new: CommitRecord
    deadline_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCommit:
    """Control plane: read the commit record (no commit of ``attempt`` can change it now)."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkObsolete:
    """Control plane and endpoints: the attempt is obsolete (control plane answers first)."""

    attempt: int
    epoch: int
    owners: tuple[str, ...]
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAndWait:
    """Control call: stop delivery and forwarding, wait for pending writes, acknowledge."""

    attempt: int
    epoch: int
    owners: tuple[str, ...]
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cleanup:
    """Transport and endpoints: release the attempt's payloads, manifest and records."""

    attempt: int
    owners: tuple[str, ...]
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestBaselineUpdate:
    """Owners: read the commit record and update the baseline it names."""

    record: CommitRecord
    owners: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReopenGate:
    """Control call: receivers invalidate KV caches, then reopen the gate at ``record``."""

    attempt: int
    epoch: int
    record: CommitRecord
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDenseRefit:
    """Operator: these receivers need a dense refit to ``record`` before the gate reopens."""

    record: CommitRecord
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ArmDeadline:
    """Report ``DeadlineExpired(attempt, stage)`` after ``seconds`` (stale reports are ignored)."""

    attempt: int
    stage: Stage
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionEnded:
    """This coordinator's part of the transition is over."""

    outcome: TransitionOutcome
    record: CommitRecord
    """The commit record as this coordinator last knew it."""
    attempt: int | None
    reason: str = ""


CoordinatorCommand = (
    RegisterAttempt | Prepare | StartStreaming | WaitForRequests | OpenApply | Flush
    | CompareAndSet | ReadCommit | MarkObsolete | StopAndWait | Cleanup | RequestBaselineUpdate
    | ReopenGate | RequestDenseRefit | ArmDeadline | TransitionEnded
)  # fmt: skip

# --- endpoints -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Notify:
    """Send ``event`` to the coordinator (a reply to a control call, or a report)."""

    event: CoordinatorEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Free everything held for the attempt (payload bytes, records, queue slots)."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildBucket:
    """Owner engine: build, encode and compress the next bucket as payload ``payload_id``."""

    attempt: int
    payload_id: int
    mode: Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class SendPayload:
    """Owner engine: hand payload ``payload_id`` to the transport."""

    attempt: int
    payload_id: int
    final: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StopStreaming:
    """Owner engine: build and send nothing more for the attempt; finish what is in flight."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateBaseline:
    """Owner engine: write the candidate into trackers and residual baseline (idempotent)."""

    record: CommitRecord


OwnerCommand = Notify | Release | BuildBucket | SendPayload | StopStreaming | UpdateBaseline


@dataclass(frozen=True, slots=True, kw_only=True)
class Discard:
    """Receiver engine: drop these payload bytes (``reason``: obsolete, duplicate, ...)."""

    key: PayloadKey
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePayload:
    """Receiver engine: keep the verified compressed bytes until ``Decode`` or ``Release``."""

    key: PayloadKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Decode:
    """Receiver engine: decode a staged payload into the bounded queue."""

    key: PayloadKey


@dataclass(frozen=True, slots=True, kw_only=True)
class Apply:
    """Receiver engine: apply these decoded payloads, in this order, through the native loader."""

    attempt: int
    keys: tuple[PayloadKey, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseIngest:
    """Receiver engine: the queue is full; stop reading payloads except ``want``.

    ``want`` is the next payload in declared order when it has not arrived yet: the queue
    keeps a slot for it so that later payloads cannot block it (paper App. B.1).
    """

    attempt: int
    want: PayloadKey | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeIngest:
    """Receiver engine: the queue has room again."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseGate:
    """Receiver engine: admit no new requests; report ``RequestsDrained`` when none is running."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Synchronize:
    """Receiver engine: wait for the attempt's device work; report ``Synchronized``."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidateKvCache:
    """Receiver engine: drop every KV-cache entry computed with the previous weights."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenGate:
    """Receiver engine: admit requests again (always after ``InvalidateKvCache``)."""


ReceiverCommand = (
    Notify | Release | Discard | StagePayload | Decode | Apply | PauseIngest | ResumeIngest
    | CloseGate | Synchronize | InvalidateKvCache | OpenGate
)  # fmt: skip

Command = CoordinatorCommand | OwnerCommand | ReceiverCommand
