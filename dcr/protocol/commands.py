"""Commands: what the protocol cores ask the engine to do.

A core returns a list of commands for every event.  The engine executes them in list order
(each command may start asynchronous work; the core never waits for it) and reports what
happens as events.  Control calls are :class:`Call` commands carrying one message of
:mod:`dcr.protocol.messages`; endpoints answer with :class:`Notify`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol import messages as msg
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey, Stage, TransitionOutcome

__all__ = [
    "Acknowledge",
    "Apply",
    "ArmDeadline",
    "BuildBucket",
    "Call",
    "CheckPayload",
    "CheckRetired",
    "CloseGate",
    "Command",
    "CompareAndSet",
    "CoordinatorCommand",
    "Decode",
    "Discard",
    "FetchRecord",
    "InvalidateKvCache",
    "Notify",
    "OpenGate",
    "OwnerCommand",
    "ReadCommit",
    "ReceiverCommand",
    "RecordObsolete",
    "RegisterAttempt",
    "Release",
    "ReleaseDelivery",
    "RequestDenseRefit",
    "SendDense",
    "SendPayload",
    "StagePayload",
    "StopDelivery",
    "StopStreaming",
    "Synchronize",
    "TransitionEnded",
    "UpdateBaseline",
]

# --- coordinator ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """Control call: deliver ``message`` to each endpoint in ``to`` (replies come back as
    events, one per endpoint)."""

    to: tuple[str, ...]
    message: msg.Call


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisterAttempt:
    """Control plane: accept the prepare of ``info`` only from the active coordinator and only
    while the record still equals ``info.base``; otherwise answer ``Conflict``."""

    info: AttemptInfo


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
class RecordObsolete:
    """Control plane: refuse every later commit of ``attempt``; report ``ObsoleteMarked``."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopDelivery:
    """Transport: ``stop_and_wait(attempt)`` -- stop delivery, wait until nothing is in flight."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseDelivery:
    """Transport: ``cleanup(attempt)`` -- release the attempt's payloads and manifest."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckRetired:
    """Supervisor: report ``Retired`` for each of ``endpoints`` whose process is confirmed gone
    (so that ``stop_and_wait`` need not wait for it)."""

    attempt: int
    endpoints: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDenseRefit:
    """Supervisor: these receivers need a dense refit to ``record`` (after an abort, before
    the gate reopens, or after their proof of the base version failed, before they rejoin)."""

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
    """This coordinator's part of the transition is over.

    ``committed_by`` is the epoch of the coordinator whose compare-and-set committed
    ``record`` (this one, or a replaced one whose commit landed first), ``None`` when nothing
    was committed.
    """

    outcome: TransitionOutcome
    record: CommitRecord
    """The commit record as this coordinator last knew it."""
    attempt: int | None
    reason: str = ""
    committed_by: int | None = None


CoordinatorCommand = (
    Call | RegisterAttempt | CompareAndSet | ReadCommit | RecordObsolete | StopDelivery
    | ReleaseDelivery | CheckRetired | RequestDenseRefit | ArmDeadline | TransitionEnded
)  # fmt: skip

# --- endpoints -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Notify:
    """Send ``message`` to the coordinator (a reply to a control call, or a report)."""

    message: msg.Reply


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


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchRecord:
    """Owner engine: read the commit record and report ``CommitRecordRead``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SendDense:
    """Owner engine: build every element it owns at its baseline ``record`` into payloads of
    ``job`` (overwrite, run-coded) and send them to ``to``; report ``DenseSent``."""

    job: int
    record: CommitRecord
    to: frozenset[str]


OwnerCommand = (
    Notify | Release | BuildBucket | SendPayload | StopStreaming | FetchRecord | UpdateBaseline
    | SendDense
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckPayload:
    """Receiver engine: acknowledge ``delivery`` to the transport (queueing ACK) and run the
    reception checks on its bytes; report ``PayloadArrived``."""

    delivery: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Acknowledge:
    """Receiver engine: acknowledge a parked ``delivery`` to the transport without reading it,
    so that the transport's credit window keeps room for the payload the declared order needs
    next; its bytes stay in host memory until it is checked or discarded."""

    delivery: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Discard:
    """Receiver engine: drop the bytes of ``delivery`` (``reason``: obsolete, duplicate, ...);
    acknowledge it to the transport if that did not happen yet."""

    delivery: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePayload:
    """Receiver engine: keep the verified bytes of ``delivery`` as payload ``key`` until
    ``Decode`` or ``Release``."""

    key: PayloadKey
    delivery: int
    keep_decoded: bool = False
    """Keep the decode done by the reception checks too (the bounded queue accounts for it):
    always in synchronous RL; in asynchronous RL while the queue has room but for one slot
    (past that, compressed bytes only until a slot frees)."""


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
    Notify | Release | CheckPayload | Acknowledge | Discard | StagePayload | Decode | Apply
    | CloseGate | Synchronize | InvalidateKvCache | OpenGate | ArmDeadline
)  # fmt: skip

Command = CoordinatorCommand | OwnerCommand | ReceiverCommand
