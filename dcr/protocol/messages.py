"""The control vocabulary: every coordinator -> endpoint call and endpoint -> coordinator reply.

Each message is one typed class, used unchanged by the cores, the engine, the control-channel
codec (:mod:`dcr.adapters.control.codec`) and the test worlds.
A coordinator core asks for a call with
:class:`~dcr.protocol.commands.Call`; an endpoint core receives the same object and answers
with :class:`~dcr.protocol.commands.Notify` carrying a reply.  Calls and replies may be lost,
duplicated or reordered on the way; every core ignores what does not concern it (paper App. B,
failure model).  Payload bytes never travel here: they go over a transport.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dcr.protocol.proof import Proof, ProofRequest
from dcr.protocol.types import AttemptInfo, CommitRecord

__all__ = [
    "CALLS",
    "MESSAGES",
    "REPLIES",
    "XOR_REFUSED_MAX_BYTES",
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
    "refused_size",
]

XOR_REFUSED_MAX_BYTES = 1 << 18
"""The most a set of refused names (``xor_refused``) may take in one control message, as
counted by :func:`refused_size` (about 4,000 names of 60 bytes).  A receiver whose set is
larger reports none and a coordinator whose union is larger binds none: the integration
setup's ``xor_names`` decide instead."""


def refused_size(names: Iterable[str]) -> int:
    """The size of a set of refused names against :data:`XOR_REFUSED_MAX_BYTES`: the UTF-8
    bytes of every name plus one each."""
    return sum(len(n.encode("utf-8", "surrogatepass")) + 1 for n in names)


def _refused_field() -> Any:
    """A set of refused canonical names, added to the control vocabulary after its first
    version: omitted from the frame while ``None`` (so frames of senders that predate it
    decode unchanged), at most :data:`XOR_REFUSED_MAX_BYTES` (:mod:`dcr.adapters.control.codec`)."""
    return field(default=None, metadata={"optional": True, "max_bytes": XOR_REFUSED_MAX_BYTES})


# --- calls: coordinator -> owners and receivers ----------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepare:
    """Bind a fresh attempt (Algorithm B.1, admission); endpoints answer accepted or rejected.

    ``proof`` asks every endpoint to prove the base version with its acceptance (a sample of
    stored bits, and the fingerprint when requested; :mod:`dcr.protocol.proof`).

    ``xor_refused`` binds the attempt's loader classification: the union of the canonical
    names whose path through some required receiver's native loader does not preserve stored
    bits (their status reports).  In mixed mode owners encode every other catalog name
    relative to the old bits where their projection allows, and these as overwrites; each
    receiver rejects the prepare (``classification``) when the catalog less this set is not
    within what its own loader allows.  ``None`` (a required receiver has not reported, or
    overwrite mode): the integration setup's ``xor_names`` are what may travel relative.
    """

    info: AttemptInfo
    proof: ProofRequest | None = None
    xor_refused: frozenset[str] | None = _refused_field()


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
    """A receiver restored ``record`` by a dense refit; it may join at the next prepare.

    ``job`` is the dense-refit job that restored it (``None``: restored without one, in the
    same process), so that a late report of a restarted receiver's old process is not taken
    for the new one's.
    """

    receiver: str
    record: CommitRecord
    job: int | None = field(default=None, metadata={"optional": True})


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointStatus:
    """What an endpoint holds, sent when it connects to a coordinator and when it changes.

    ``role`` is ``owner`` or ``receiver``; ``incarnation`` changes with every process start,
    so a coordinator recognises a restarted endpoint.  An owner's ``record`` is its baseline
    and ``candidate`` says it staged the next version on top of it; a receiver's ``record`` is
    the committed version its storage holds exactly, ``None`` while it must restore one by
    dense refit.

    ``xor_refused`` is a prewarmed receiver's loader classification: the canonical names whose
    path through its native loader does not preserve stored bits (casts, transforms), which
    must travel as overwrites.  ``None``: an owner, a receiver not prewarmed yet, or a set
    larger than :data:`XOR_REFUSED_MAX_BYTES`.
    """

    endpoint: str
    role: str
    incarnation: str
    record: CommitRecord | None
    candidate: bool = False
    xor_refused: frozenset[str] | None = _refused_field()


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
