"""The vocabulary every action of ``models/refit.tla`` shares: the explored bounds
(:class:`Config`), one successor (:class:`Step`), the initial state, the :class:`Builder`
that rewrites a state along lifecycle edges, and the helpers the actions use (which
coordinators act, which receivers an attempt still binds, ...).

Abstractions (see ``docs/protocol.md``): each owner sends one payload per attempt covering one
range of every receiver's storage; control calls reach every live endpoint of the attempt
atomically (the engine retries them and they are idempotent); payloads travel individually
and may be lost, duplicated, reordered or arrive after their attempt is obsolete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dcr.protocol.lifecycle import (
    EDGES,
    AnyEdge,
    AttemptPhase,
    OwnerPhase,
    Phase,
    ReceiverPhase,
    TransitionPhase,
    Trigger,
)
from dcr.testing.spec.memo import evolve
from dcr.testing.spec.state import (
    NONE,
    V0,
    AttemptVar,
    Budgets,
    CoordVar,
    Encoding,
    OwnerVar,
    Payload,
    ReceiverVar,
    State,
)

__all__ = [
    "ATTEMPT_RUNNING",
    "NEXT",
    "RECEIVER_RUNNING",
    "TERMINAL",
    "Action",
    "Builder",
    "Config",
    "Step",
    "acting",
    "awaits_outcome",
    "dirty",
    "encoding_of",
    "fail_transition",
    "initial_state",
    "live_receivers",
    "payload_key",
]

_A = AttemptPhase
_T = TransitionPhase
_O = OwnerPhase
_R = ReceiverPhase
_X = Trigger

NEXT: dict[tuple[Phase, Trigger], AnyEdge] = {(e.source, e.trigger): e for e in EDGES}
ATTEMPT_RUNNING = frozenset({_A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING})
RECEIVER_RUNNING = frozenset({_R.PREPARED, _R.GATED, _R.APPLYING, _R.FLUSHING})


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Bounds of the explored configuration."""

    owners: int = 2
    receivers: int = 3
    max_attempts: int = 3
    sync: bool = True
    failovers: int = 1
    failures: int = 2
    """Attempt failures the environment may cause (timeouts, bad payloads, rejects)."""
    losses: int = 0
    duplicates: int = 0
    crashes: int = 0
    reply_losses: int = 0
    aborts: int = 0
    replaced_acts: bool = True
    """A replaced coordinator keeps running until the control plane tells it; when False it
    stands down at the takeover (its commit already in flight can still land)."""
    atomic_delivery: bool = False
    """A sent payload reaches every live receiver of its attempt at once (no loss, duplicate
    or late arrival; for larger configurations)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One successor: which action with which arguments, the new state, the edges taken."""

    label: str
    state: State
    edges: tuple[AnyEdge, ...]


Action = Callable[[State, Config], Iterator[Step]]


def initial_state(cfg: Config) -> State:
    """Version ``v`` committed everywhere; coordinator 1 is active, one spare per failover."""
    idle = CoordVar(
        started=False,
        tphase=_T.IDLE,
        aphase=_A.PLANNED,
        attempt=NONE,
        overwrite=False,
        admitted=False,
        reported=frozenset(),
        stopped=False,
    )
    return State(
        record=NONE,
        commit_epoch=NONE,
        epoch=1,
        registered=NONE,
        coords=(idle._replace(started=True),) + (idle,) * cfg.failovers,
        attempts=(),
        owners=tuple(OwnerVar(_O.IDLE, NONE, V0, False) for _ in range(cfg.owners)),
        receivers=tuple(
            ReceiverVar(
                phase=_R.READY,
                attempt=NONE,
                inc=0,
                gate_open=True,
                kv=V0,
                storage=(V0,) * cfg.owners,
                staged=frozenset(),
                applied=frozenset(),
                held=V0,
                epoch=0,
                acked=NONE,
            )
            for _ in range(cfg.receivers)
        ),
        inflight=frozenset(),
        budgets=Budgets(
            losses=cfg.losses,
            duplicates=cfg.duplicates,
            crashes=cfg.crashes,
            failovers=cfg.failovers,
            reply_losses=cfg.reply_losses,
            failures=cfg.failures,
            aborts=cfg.aborts,
        ),
    )


class Builder:
    """Collects the edges one action takes while it rewrites the state."""

    def __init__(self, s: State) -> None:
        self.s = s
        self.edges: list[AnyEdge] = []
        self.coords = list(s.coords)
        self.attempts = list(s.attempts)
        self.owners = list(s.owners)
        self.receivers = list(s.receivers)

    def go(self, phase: Phase, trigger: Trigger) -> Phase:
        edge = NEXT[(phase, trigger)]  # a missing edge is a bug in the mirror
        self.edges.append(edge)
        return edge.dest

    def may(self, phase: Phase, trigger: Trigger) -> bool:
        return (phase, trigger) in NEXT

    def coord(self, c: int, **changes: Any) -> None:
        self.coords[c - 1] = self.coords[c - 1]._replace(**changes)

    def attempt(self, tau: int, **changes: Any) -> None:
        self.attempts[tau - 1] = self.attempts[tau - 1]._replace(**changes)

    def owner(self, o: int, **changes: Any) -> None:
        self.owners[o] = self.owners[o]._replace(**changes)

    def receiver(self, r: int, **changes: Any) -> None:
        self.receivers[r] = self.receivers[r]._replace(**changes)

    def step(self, label: str, **changes: Any) -> Step:
        state = evolve(
            self.s,
            coords=tuple(self.coords),
            attempts=tuple(self.attempts),
            owners=tuple(self.owners),
            receivers=tuple(self.receivers),
            **changes,
        )
        return Step(label, state, tuple(self.edges))


def acting(s: State, cfg: Config) -> Iterator[tuple[int, CoordVar]]:
    """Coordinators that may act: started ones; replaced ones only if the config lets them."""
    for i, c in enumerate(s.coords):
        if c.started and (cfg.replaced_acts or i + 1 == s.epoch):
            yield i + 1, c


def live_receivers(s: State, tau: int) -> list[int]:
    """Receivers of attempt ``tau`` that are still the process that was prepared."""
    return [r for r, inc in sorted(s.attempt(tau).required) if s.receivers[r].inc == inc]


def fail_transition(b: Builder, c: int, cv: CoordVar, trigger: Trigger) -> None:
    """The transition's reaction to a failed attempt (Algorithm B.2, lines 26 and 43)."""
    if cv.tphase in (_T.ADMITTING, _T.RUNNING):
        b.coord(c, tphase=b.go(cv.tphase, trigger), overwrite=cv.admitted)


def dirty(rx: ReceiverVar) -> bool:
    """Writes of some attempt landed since the receiver held a committed version."""
    return any(v != rx.held for v in rx.storage)


def awaits_outcome(s: State, tau: int) -> bool:
    """Some coordinator still waits for the commit outcome of ``tau`` (else time is moot)."""
    return any(
        c.started and c.attempt == tau and c.aphase in (_A.COMMITTING, _A.UNKNOWN) for c in s.coords
    )


TERMINAL = frozenset({_T.COMMITTED, _T.REJECTED, _T.ABORTED, _T.STOOD_DOWN})


def payload_key(p: Payload) -> tuple[int, int, int, int]:
    return (p.attempt, p.range, p.receiver, int(p.encoding))


def encoding_of(s: State, a: AttemptVar, owner: int) -> Encoding:
    if a.overwrite:
        return Encoding.OVERWRITE
    return Encoding.XOR_V0 if s.owners[owner].baseline == V0 else Encoding.XOR_V1
