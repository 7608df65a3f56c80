"""The control vocabulary: every coordinator -> endpoint call and endpoint -> coordinator reply.

Each message is one typed class, used unchanged by the cores, the engine, the control-channel
codec (:mod:`dcr.wire.control`) and the test worlds.  A coordinator core asks for a call with
:class:`~dcr.protocol.commands.Call`; an endpoint core receives the same object and answers
with :class:`~dcr.protocol.commands.Notify` carrying a reply.  Calls and replies may be lost,
duplicated or reordered on the way; every core ignores what does not concern it (paper App. B,
failure model).  Payload bytes never travel here: they go over a transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcr.protocol.proof import Proof, ProofRequest
from dcr.protocol.types import AttemptInfo, CommitRecord

__all__ = [
    "CALLS",
    "MESSAGES",
    "REPLIES",
    "Acked",
    "AttemptFailed",
    "BaselineUpdated",
    "Call",
    "CheckArrival",
    "Cleanup",
    "DenseRefit",
    "Disproved",
    "EndpointStatus",
    "Flush",
    "GateClosed",
    "MarkObsolete",
    "Message",
    "OpenApply",
    "Prepare",
    "PrepareAccepted",
    "PrepareRejected",
    "ReadRecord",
    "ReceiverReady",
    "ReopenGate",
    "Reply",
    "Retired",
    "SendsDone",
    "Staged",
    "StartStreaming",
    "StopAndWait",
    "Stopped",
    "WaitForRequests",
]

# --- calls: coordinator -> owners and receivers ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    """Bind a fresh attempt (Algorithm B.1, admission); endpoints answer accepted or rejected.

    ``proof`` asks every endpoint to prove the base version with its acceptance (a sample of
    stored bits, and the fingerprint when requested; :mod:`dcr.protocol.proof`).
    """

    info: AttemptInfo
    proof: ProofRequest | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StartStreaming:
    """Owners: start building and sending the attempt's buckets."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitForRequests:
    """Receivers: close the request gate and wait for in-flight requests."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenApply:
    """Receivers: the attempt's payloads may be applied."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckArrival:
    """Asynchronous RL, receivers: every owner finished sending; ``expected`` lists
    ``(owner, payload count)``.  A receiver that still misses a payload once the transport's
    arrival grace has passed fails the attempt instead of waiting for a deadline."""

    attempt: int
    expected: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    """Owners close their sends; receivers check arrival against ``expected`` (the owners'
    declared sent lists ``(owner, payload count)``), drain their queue and acknowledge."""

    attempt: int
    expected: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkObsolete:
    """Ignore the attempt's later payloads and ``open_apply``."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StopAndWait:
    """Stop the attempt; answer :class:`Stopped` once its pending writes finished."""

    attempt: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Cleanup:
    """Release the attempt's payloads and records."""

    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReopenGate:
    """Receivers: drop the KV cache and reopen the gate; ``record`` is the committed version."""

    attempt: int
    epoch: int
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadRecord:
    """Owners: read the commit record and update the baseline it names (paper §6.3)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseRefit:
    """Restore ``record`` on ``receivers`` by a dense refit sent over the transport.

    Owners send every element they own at ``record`` (overwrite, run-coded) as payloads of
    ``job`` addressed to ``receivers`` and answer :class:`SendsDone` with ``attempt=job``;
    each receiver applies them through its native loader and answers :class:`ReceiverReady`
    (paper App. B.2, joining receivers).  A :class:`CheckArrival` of ``job`` fails a restore
    whose payloads were lost on the way.
    """

    job: int
    record: CommitRecord
    owners: tuple[str, ...]
    receivers: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Disproved:
    """Receivers: your proof of the attempt's base version failed (``reason`` says where).

    The receiver no longer claims to hold any committed record: it closes its request gate,
    fails the attempt and waits for a dense refit, after which it joins again (paper App.
    B.2, joining receivers).
    """

    attempt: int
    epoch: int
    reason: str = ""


Call = (
    Prepare | StartStreaming | WaitForRequests | OpenApply | CheckArrival | Flush | MarkObsolete
    | StopAndWait | Cleanup | ReopenGate | ReadRecord | DenseRefit | Disproved
)  # fmt: skip

# --- replies: endpoints (and their supervisor) -> coordinators ------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareAccepted:
    """An endpoint bound the attempt (its metadata and loader classification checks passed).

    ``proof`` answers the prepare's proof request (``None`` when none was asked for).
    """

    attempt: int
    endpoint: str
    proof: Proof | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareRejected:
    """An endpoint's prepare check failed (``reject`` in Algorithm B.2)."""

    attempt: int
    endpoint: str
    check: str
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFailed:
    """An endpoint reports that the attempt (or dense-refit job) failed.

    ``check`` names what failed: ``digest``, ``conflicting-duplicate``, ``declared-order``,
    ``missing``, ``apply``, ``encode``, ``transport``, ``version``, ``joining``, ...
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
    """An endpoint's process and pending writes are confirmed unable to resume.

    Sent by whoever supervises the endpoint's process, not by the endpoint itself.
    """

    attempt: int
    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineUpdated:
    """An owner finished the in-place baseline update named by ``record``."""

    owner: str
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverReady:
    """A receiver restored ``record`` by a dense refit; it may join at the next prepare."""

    receiver: str
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointStatus:
    """What an endpoint holds, sent when it connects to a coordinator and when it changes.

    ``role`` is ``owner`` or ``receiver``; ``incarnation`` changes with every process start,
    so a coordinator recognises a restarted endpoint.  An owner's ``record`` is its baseline
    and ``candidate`` says it staged the next version on top of it; a receiver's ``record`` is
    the committed version its storage holds exactly, ``None`` while it must restore one by
    dense refit.
    """

    endpoint: str
    role: str
    incarnation: str
    record: CommitRecord | None
    candidate: bool = False


Reply = (
    PrepareAccepted | PrepareRejected | AttemptFailed | SendsDone | Staged | GateClosed | Acked
    | Stopped | Retired | BaselineUpdated | ReceiverReady | EndpointStatus
)  # fmt: skip

Message = Call | Reply

CALLS: tuple[type[Call], ...] = (
    Prepare, StartStreaming, WaitForRequests, OpenApply, CheckArrival, Flush, MarkObsolete,
    StopAndWait, Cleanup, ReopenGate, ReadRecord, DenseRefit, Disproved,
)  # fmt: skip
REPLIES: tuple[type[Reply], ...] = (
    PrepareAccepted, PrepareRejected, AttemptFailed, SendsDone, Staged, GateClosed, Acked,
    Stopped, Retired, BaselineUpdated, ReceiverReady, EndpointStatus,
)  # fmt: skip
MESSAGES: tuple[type[Message], ...] = (*CALLS, *REPLIES)
"""Every control message class; the codec assigns each a stable tag by name."""
