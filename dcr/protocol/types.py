"""Values the protocol cores exchange: commit records, attempt descriptions, ids, timeouts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from dcr.errors import ConfigError

__all__ = [
    "AttemptInfo",
    "CommitOutcome",
    "CommitRecord",
    "CounterIds",
    "EpochIds",
    "IdSource",
    "Mode",
    "PayloadKey",
    "Stage",
    "Timeouts",
    "TransitionOutcome",
]


class Mode(enum.Enum):
    """Encoding mode of an attempt (paper §5)."""

    MIXED = "mixed"
    """XOR wherever the path preserves stored bits, overwrite elsewhere (the default)."""
    OVERWRITE = "overwrite"
    """Every entry is an absolute overwrite (retries after a failed attempt)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord:
    """The durable commit record ``K = (version, g)``, changed only by compare-and-set."""

    version: int
    candidate: str
    """The candidate-baseline id ``g`` of the attempt that committed ``version``."""

    def __str__(self) -> str:
        return f"({self.version}, {self.candidate})"


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptInfo:
    """What prepare binds to a fresh attempt ``tau`` (paper App. B.1, admission)."""

    attempt: int
    candidate: str
    """``g``: names the candidate baseline ``(v+1, g)`` this attempt would commit."""
    base: CommitRecord
    """``K^v``: the committed record the attempt starts from and its commit expects."""
    mode: Mode
    sync: bool
    """Synchronous RL (gate closed at the first attempt) or asynchronous RL (staging)."""
    coordinator: int
    """Epoch of the coordinator that prepared the attempt."""
    owners: tuple[str, ...]
    """Every owner, in the order that breaks ties of the declared application order."""
    receivers: frozenset[str]
    """The required receivers; membership changes only between attempts."""

    @property
    def target(self) -> CommitRecord:
        """``(v+1, g)``: the record a successful commit of this attempt writes."""
        return CommitRecord(version=self.base.version + 1, candidate=self.candidate)


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class PayloadKey:
    """Deduplication key of a payload: ``(attempt, owner, payload id)`` (paper App. B.1)."""

    attempt: int
    owner: str
    payload_id: int


class CommitOutcome(enum.Enum):
    """Outcome ``c`` of commit or read_commit (paper App. B.2, commit outcomes)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    CONFLICT = "conflict"


class TransitionOutcome(enum.Enum):
    """What a coordinator reports when its part of a transition ends (Algorithm B.2)."""

    COMMITTED = "committed"
    """This coordinator committed ``v+1``."""
    CONFLICT = "conflict"
    """Another coordinator committed (or replaced this one)."""
    REJECTED = "rejected"
    """The first prepare was rejected; ``v`` stays committed."""
    ABORTED = "aborted"
    """The operator aborted the transition."""


class Stage(enum.Enum):
    """What a deadline guards; the engine turns an expired timer into ``DeadlineExpired``."""

    PREPARE = "prepare"
    ARRIVAL = "arrival"
    GATE = "gate"
    FLUSH = "flush"
    COMMIT = "commit"
    STOP = "stop"
    BASELINE = "baseline"
    """After a commit: owners that have not reported their baseline update are asked again."""
    JOIN = "join"
    """Before a retry: how long it waits for receivers a failed proof sent to a dense refit
    (``CoordinatorConfig.join_wait_s``; not a :class:`Timeouts` field)."""


class IdSource(Protocol):
    """Supplies a fresh attempt id ``tau`` and candidate id ``g``.

    Attempt ids must increase over the life of the system, across coordinator epochs too:
    endpoints refuse a prepare whose attempt id is not above every attempt they have seen,
    which is how a prepare that arrives after its attempt was stopped is recognised.
    """

    def fresh(self) -> tuple[int, str]: ...


@dataclass(slots=True, kw_only=True)
class CounterIds:
    """Deterministic :class:`IdSource`: ``tau`` counts up from ``first``, ``g`` is ``prefix+tau``.

    Start each coordinator epoch above every id an earlier epoch can have used (for example
    ``first = epoch << 32``).
    """

    first: int = 1
    prefix: str = "g"
    _issued: int = field(default=0, init=False)

    def fresh(self) -> tuple[int, str]:
        tau = self.first + self._issued
        self._issued += 1
        return tau, f"{self.prefix}{tau}"


@dataclass(slots=True)
class EpochIds:
    """Every id a coordinator of ``epoch`` issues: one source, so ids never collide.

    Attempt ids (:meth:`attempts`) count up from ``epoch << 32``; dense-refit job ids
    (:meth:`dense_job`) from ``(epoch << 32) | 1 << 31``: above every attempt of the epoch,
    below every id of the next one.  A coordinator that takes over claims a newer epoch, so
    its ids resume above everything the replaced one can have issued.
    """

    epoch: int
    _jobs: int = field(default=0, init=False)

    def attempts(self) -> CounterIds:
        """The attempt ids (and candidate ids ``g<epoch>.<tau>``) of this epoch."""
        return CounterIds(first=self.epoch << 32, prefix=f"g{self.epoch}.")

    def dense_job(self) -> int:
        """A fresh dense-refit job id of this epoch."""
        self._jobs += 1
        return (self.epoch << 32) | (1 << 31) | self._jobs


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Seconds the engine waits before it reports ``DeadlineExpired`` for a stage."""

    prepare_s: float = 60.0
    arrival_s: float = 600.0
    gate_s: float = 300.0
    flush_s: float = 600.0
    commit_s: float = 30.0
    """The commit deadline: the control plane refuses the compare-and-set after it."""
    stop_s: float = 300.0
    baseline_s: float = 10.0
    """How often owners that have not reported their baseline update are asked again (a
    restarted owner never got the first call)."""

    def __post_init__(self) -> None:
        for name in (
            "prepare_s", "arrival_s", "gate_s", "flush_s", "commit_s", "stop_s", "baseline_s",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConfigError(f"timeout {name} must be positive")

    def of(self, stage: Stage) -> float:
        value: float = getattr(self, f"{stage.value}_s")
        return value
