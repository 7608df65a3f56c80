"""The variables of ``models/refit.tla`` as frozen dataclasses.

One transition ``v -> v+1`` is modelled.  The per-process records are named tuples (cheap
to copy and hash: the model checker creates millions of them); ``State`` is a frozen
dataclass that caches its hash.  Versions are small integers: ``V0`` is ``v`` and
``V1`` is ``v+1``.  Receiver storage is abstract: one value per *range* (the destinations of
one owner's payload), which records which version's bits the range holds, or ``BAD`` when an
XOR entry landed on bits other than the base it was computed from, or ``LOST`` after a crash.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from dcr.protocol.lifecycle import AttemptPhase, OwnerPhase, ReceiverPhase, TransitionPhase

__all__ = [
    "BAD",
    "EMPTY",
    "LOST",
    "NONE",
    "V0",
    "V1",
    "AttemptVar",
    "Budgets",
    "Cas",
    "CoordVar",
    "Encoding",
    "OwnerVar",
    "Payload",
    "ReceiverVar",
    "Reply",
    "State",
    "apply_entry",
]

V0 = 0
"""Bits of version ``v`` (the committed version when the transition starts)."""
V1 = 1
"""Bits of version ``v+1`` (what a dense refit of the candidate writes)."""
BAD = 2
"""An XOR entry landed on bits other than its base: neither version."""
LOST = 3
"""A crashed receiver's storage: unknown until a dense refit."""
EMPTY = -1
"""An empty KV cache."""
NONE = 0
"""No attempt / the record still holds ``K^v``."""


class Encoding(enum.IntEnum):
    """How an abstract payload entry changes a range."""

    XOR_V0 = 0
    """Mixed mode, mask computed against baseline ``v``."""
    XOR_V1 = 1
    """Mixed mode, mask computed against baseline ``v+1`` (only a broken owner sends it)."""
    OVERWRITE = 2


def apply_entry(value: int, encoding: Encoding) -> int:
    """Storage after one entry lands on ``value`` (XOR is exact only on its own base)."""
    if encoding is Encoding.OVERWRITE:
        return V1
    base = V0 if encoding is Encoding.XOR_V0 else V1
    return V1 if value == base == V0 else BAD


class Cas(enum.IntEnum):
    NONE = 0
    IN_FLIGHT = 1
    DONE = 2


class Reply(enum.IntEnum):
    NONE = 0
    SUCCEEDED = 1
    FAILED = 2
    CONFLICT = 3
    LOST = 4


class CoordVar(NamedTuple):
    """One coordinator: its transition phase and its view of its current attempt."""

    started: bool
    tphase: TransitionPhase
    aphase: AttemptPhase
    attempt: int
    overwrite: bool
    """Mode of the coordinator's next attempt."""
    admitted: bool
    reported: frozenset[int]
    """Owners that reported the baseline update to this coordinator."""
    stopped: bool
    """The current attempt's endpoints all stopped (stop_and_wait returned)."""


class AttemptVar(NamedTuple):
    """What the control plane and the endpoints know about one attempt."""

    coord: int
    overwrite: bool
    required: frozenset[tuple[int, int]]
    """``(receiver, incarnation)`` bound at prepare."""
    acks: frozenset[tuple[int, int]]
    """``(receiver, incarnation)`` that sent a completion ACK for this attempt."""
    obsolete: bool
    cas: Cas
    reply: Reply
    expired: bool
    """The commit deadline passed: the control plane accepts no commit of the attempt."""


class OwnerVar(NamedTuple):
    phase: OwnerPhase
    attempt: int
    baseline: int
    sent: bool


class ReceiverVar(NamedTuple):
    phase: ReceiverPhase
    attempt: int
    inc: int
    """Incarnation: a restarted process is a new endpoint."""
    gate_open: bool
    kv: int
    """Version the KV cache was computed with, or ``EMPTY``."""
    storage: tuple[int, ...]
    staged: frozenset[tuple[int, Encoding]]
    """``(range, encoding)`` of payloads ingested for the active attempt, not yet applied."""
    applied: frozenset[int]
    held: int
    """The committed version the receiver claims to hold (``EMPTY`` while joining)."""
    epoch: int
    acked: int
    """The attempt this receiver fully applied and acknowledged (``NONE`` if none)."""


class Payload(NamedTuple):
    """A payload in flight: attempt, range (owner), destination receiver, encoding."""

    attempt: int
    range: int
    receiver: int
    encoding: Encoding


class Budgets(NamedTuple):
    """Faults the environment may still inject (bounds the explored configuration)."""

    losses: int = 0
    duplicates: int = 0
    crashes: int = 0
    failovers: int = 0
    reply_losses: int = 0
    failures: int = 0
    aborts: int = 0


@dataclass(frozen=True, slots=True)
class State:
    """One state of the specification (the TLA+ variables)."""

    record: int
    """``NONE`` while the record holds ``K^v``, else the attempt whose ``(v+1, g)`` it names."""
    commit_epoch: int
    """Active coordinator epoch at the moment the record changed (``NONE`` before)."""
    epoch: int
    """The active coordinator (the control plane accepts prepare and commit only from it)."""
    registered: int
    """Last attempt the control plane registered."""
    coords: tuple[CoordVar, ...]
    attempts: tuple[AttemptVar, ...]
    owners: tuple[OwnerVar, ...]
    receivers: tuple[ReceiverVar, ...]
    inflight: frozenset[Payload]
    budgets: Budgets
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.record, self.commit_epoch, self.epoch, self.registered, self.coords)
        rest = (self.attempts, self.owners, self.receivers, self.inflight, self.budgets)
        object.__setattr__(self, "_hash", hash(fields + rest))

    def __hash__(self) -> int:
        return self._hash

    def attempt(self, tau: int) -> AttemptVar:
        return self.attempts[tau - 1]

    @property
    def record_version(self) -> int:
        return V0 if self.record == NONE else V1
