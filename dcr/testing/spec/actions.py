"""The actions of ``models/refit.tla``, one function per action with the same name.

Every action takes a :class:`State` and a :class:`Config` and yields the successor states it
allows, each with a label (the action and its arguments) and the lifecycle edges it took.
Phases move only along :data:`dcr.protocol.lifecycle.EDGES`, so the search can report which
edges of the table it reached.

Abstractions (see ``docs/protocol.md``): each owner sends one payload per attempt covering one
range of every receiver's storage; control calls reach every live endpoint of the attempt
atomically (the engine retries them and they are idempotent); payloads travel individually
and may be lost, duplicated, reordered or arrive after their attempt is obsolete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
from dcr.testing.spec.state import (
    EMPTY,
    LOST,
    NONE,
    V0,
    V1,
    AttemptVar,
    Budgets,
    Cas,
    CoordVar,
    Encoding,
    OwnerVar,
    Payload,
    ReceiverVar,
    Reply,
    State,
    apply_entry,
)

__all__ = [
    "ACTIONS",
    "ENVIRONMENT",
    "Action",
    "Config",
    "Step",
    "initial_state",
]

_A = AttemptPhase
_T = TransitionPhase
_O = OwnerPhase
_R = ReceiverPhase
_X = Trigger

_NEXT: dict[tuple[Phase, Trigger], AnyEdge] = {(e.source, e.trigger): e for e in EDGES}
_ATTEMPT_RUNNING = frozenset({_A.PREPARING, _A.STREAMING, _A.GATING, _A.APPLYING, _A.FLUSHING})
_RECEIVER_RUNNING = frozenset({_R.PREPARED, _R.GATED, _R.APPLYING, _R.FLUSHING})


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


class _Builder:
    """Collects the edges one action takes while it rewrites the state."""

    def __init__(self, s: State) -> None:
        self.s = s
        self.edges: list[AnyEdge] = []
        self.coords = list(s.coords)
        self.attempts = list(s.attempts)
        self.owners = list(s.owners)
        self.receivers = list(s.receivers)

    def go(self, phase: Phase, trigger: Trigger) -> Phase:
        edge = _NEXT[(phase, trigger)]  # a missing edge is a bug in the mirror
        self.edges.append(edge)
        return edge.dest

    def may(self, phase: Phase, trigger: Trigger) -> bool:
        return (phase, trigger) in _NEXT

    def coord(self, c: int, **changes: Any) -> None:
        self.coords[c - 1] = self.coords[c - 1]._replace(**changes)

    def attempt(self, tau: int, **changes: Any) -> None:
        self.attempts[tau - 1] = self.attempts[tau - 1]._replace(**changes)

    def owner(self, o: int, **changes: Any) -> None:
        self.owners[o] = self.owners[o]._replace(**changes)

    def receiver(self, r: int, **changes: Any) -> None:
        self.receivers[r] = self.receivers[r]._replace(**changes)

    def step(self, label: str, **changes: Any) -> Step:
        state = replace(
            self.s,
            coords=tuple(self.coords),
            attempts=tuple(self.attempts),
            owners=tuple(self.owners),
            receivers=tuple(self.receivers),
            **changes,
        )
        return Step(label, state, tuple(self.edges))


def _coords(s: State, cfg: Config) -> Iterator[tuple[int, CoordVar]]:
    """Coordinators that may act: started ones; replaced ones only if the config lets them."""
    for i, c in enumerate(s.coords):
        if c.started and (cfg.replaced_acts or i + 1 == s.epoch):
            yield i + 1, c


def _live(s: State, tau: int) -> list[int]:
    """Receivers of attempt ``tau`` that are still the process that was prepared."""
    return [r for r, inc in sorted(s.attempt(tau).required) if s.receivers[r].inc == inc]


def _fail_transition(b: _Builder, c: int, cv: CoordVar, trigger: Trigger) -> None:
    """The transition's reaction to a failed attempt (Algorithm B.2, lines 26 and 43)."""
    if cv.tphase in (_T.ADMITTING, _T.RUNNING):
        b.coord(c, tphase=b.go(cv.tphase, trigger), overwrite=cv.admitted)


# -- admission and streaming (Algorithm B.1) ---------------------------------------------------


def prepare(s: State, cfg: Config) -> Iterator[Step]:
    """Start an attempt; the control plane accepts it only from the active coordinator."""
    for c, cv in _coords(s, cfg):
        if cv.tphase not in (_T.IDLE, _T.READMITTING, _T.RECOVERING) or s.epoch != c:
            continue
        if cv.attempt != NONE and cv.aphase is not _A.CLEANED:
            continue
        if len(s.attempts) >= cfg.max_attempts or s.record != NONE:
            continue
        if any(o.phase is not _O.IDLE for o in s.owners):
            continue
        eligible = [
            r
            for r, rx in enumerate(s.receivers)
            if rx.epoch <= c
            and (
                rx.phase in (_R.READY, _R.CLEANED)
                or (rx.phase is _R.REFITTED and rx.held == s.record_version)
            )
        ]
        if not eligible:
            continue
        b = _Builder(s)
        tau = len(s.attempts) + 1
        b.attempts.append(
            AttemptVar(
                coord=c,
                overwrite=cv.overwrite,
                required=frozenset((r, s.receivers[r].inc) for r in eligible),
                acks=frozenset(),
                obsolete=False,
                cas=Cas.NONE,
                reply=Reply.NONE,
                expired=False,
            )
        )
        b.coord(
            c,
            tphase=b.go(cv.tphase, _X.PREPARE),
            aphase=b.go(_A.PLANNED, _X.PREPARE),
            attempt=tau,
            stopped=False,
        )
        for o, ow in enumerate(s.owners):
            b.owner(o, phase=b.go(ow.phase, _X.PREPARE), attempt=tau, sent=False)
        for r in eligible:
            rx = s.receivers[r]
            b.receiver(
                r,
                phase=b.go(rx.phase, _X.PREPARE),
                attempt=tau,
                staged=frozenset(),
                applied=frozenset(),
                epoch=c,
            )
        yield b.step(f"prepare(c{c})", registered=tau)


def send(s: State, cfg: Config) -> Iterator[Step]:
    """The coordinator starts the owners (admission); an owner sends its payload."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is _A.PREPARING:
            b = _Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.SEND))
            if cv.tphase is _T.ADMITTING:
                b.coord(c, tphase=b.go(cv.tphase, _X.SEND), admitted=True)
            for o, ow in enumerate(s.owners):
                if ow.attempt == cv.attempt and ow.phase is _O.PREPARED:
                    b.owner(o, phase=b.go(ow.phase, _X.SEND))
            yield b.step(f"send(c{c})")
    for o, ow in enumerate(s.owners):
        if ow.phase is _O.SENDING and not ow.sent:
            a = s.attempt(ow.attempt)
            enc = (
                Encoding.OVERWRITE
                if a.overwrite
                else (Encoding.XOR_V0 if ow.baseline == V0 else Encoding.XOR_V1)
            )
            b = _Builder(s)
            b.owner(o, phase=b.go(ow.phase, _X.SEND), sent=True)
            sent = frozenset(Payload(ow.attempt, o, r, enc) for r in _live(s, ow.attempt))
            if cfg.atomic_delivery:
                for p in sorted(sent, key=_payload_key):
                    _deliver(b, p)
                yield b.step(f"send(o{o})")
            else:
                yield b.step(f"send(o{o})", inflight=s.inflight | sent)


def ingest(s: State, cfg: Config) -> Iterator[Step]:
    """A payload is delivered; the receiver drops other attempts' payloads and duplicates."""
    for p in sorted(s.inflight, key=_payload_key):
        b = _Builder(s)
        _deliver(b, p)
        yield b.step(f"ingest(t{p.attempt},o{p.range},r{p.receiver})", inflight=s.inflight - {p})


def _deliver(b: _Builder, p: Payload) -> None:
    """Stage ``p`` if it belongs to the receiver's active attempt and is not a duplicate."""
    rx = b.receivers[p.receiver]
    seen = {x for x, _ in rx.staged} | rx.applied
    if rx.attempt == p.attempt and rx.phase in _RECEIVER_RUNNING and p.range not in seen:
        b.receiver(
            p.receiver,
            phase=b.go(rx.phase, _X.INGEST),
            staged=rx.staged | {(p.range, p.encoding)},
        )


def wait_for_requests(s: State, cfg: Config) -> Iterator[Step]:
    """Close the gate: at once in synchronous RL, after the arrival check in asynchronous RL."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is not _A.STREAMING:
            continue
        live = _live(s, cv.attempt)
        if not cfg.sync:
            if any(not (o.attempt == cv.attempt and o.sent) for o in s.owners):
                continue
            ranges = set(range(len(s.owners)))
            if any(
                s.receivers[r].attempt != cv.attempt
                or {x for x, _ in s.receivers[r].staged} != ranges
                for r, _ in s.attempt(cv.attempt).required
            ):
                continue
        b = _Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.WAIT_FOR_REQUESTS))
        for r in live:
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.PREPARED and rx.epoch <= c:
                b.receiver(r, phase=b.go(rx.phase, _X.WAIT_FOR_REQUESTS), gate_open=False)
        yield b.step(f"wait_for_requests(c{c})")


def open_apply(s: State, cfg: Config) -> Iterator[Step]:
    """Every required receiver closed its gate; receivers may apply (obsolete ones ignore it)."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is not _A.GATING:
            continue
        required = s.attempt(cv.attempt).required
        if any(
            s.receivers[r].inc != inc or s.receivers[r].gate_open or s.receivers[r].epoch > c
            for r, inc in required
        ):
            continue
        b = _Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.OPEN_APPLY))
        for r in _live(s, cv.attempt):
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.GATED:
                b.receiver(r, phase=b.go(rx.phase, _X.OPEN_APPLY))
        yield b.step(f"open_apply(c{c})")


def apply(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver applies the next payload in declared order (never in arrival order)."""
    for r, rx in enumerate(s.receivers):
        if rx.phase not in (_R.APPLYING, _R.FLUSHING) or len(rx.applied) == len(s.owners):
            continue
        nxt = min(set(range(len(s.owners))) - rx.applied)
        for x, enc in rx.staged:
            if x == nxt:
                b = _Builder(s)
                storage = list(rx.storage)
                storage[x] = apply_entry(storage[x], enc)
                b.receiver(
                    r,
                    phase=b.go(rx.phase, _X.APPLY),
                    storage=tuple(storage),
                    staged=rx.staged - {(x, enc)},
                    applied=rx.applied | {x},
                )
                yield b.step(f"apply(r{r},o{x})")


def flush(s: State, cfg: Config) -> Iterator[Step]:
    """Every owner sent its payload: close sends; receivers check arrival and drain."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is not _A.APPLYING:
            continue
        if any(
            not (o.attempt == cv.attempt and o.phase is _O.SENDING and o.sent) for o in s.owners
        ):
            continue
        b = _Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.FLUSH))
        for o, ow in enumerate(s.owners):
            b.owner(o, phase=b.go(ow.phase, _X.FLUSH))
        for r in _live(s, cv.attempt):
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.APPLYING:
                b.receiver(r, phase=b.go(rx.phase, _X.FLUSH))
        yield b.step(f"flush(c{c})")


def ack(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver drained every declared payload and sends its completion ACK."""
    for r, rx in enumerate(s.receivers):
        if rx.phase is _R.FLUSHING and len(rx.applied) == len(s.owners):
            b = _Builder(s)
            b.receiver(r, phase=b.go(rx.phase, _X.ACK), acked=rx.attempt)
            a = s.attempt(rx.attempt)
            b.attempt(rx.attempt, acks=a.acks | {(r, rx.inc)})
            yield b.step(f"ack(r{r})")


# -- commit (Algorithm B.2) --------------------------------------------------------------------


def commit(s: State, cfg: Config) -> Iterator[Step]:
    """Compare-and-set ``K^v -> (v+1, g)`` once every required receiver ACKed."""
    for c, cv in _coords(s, cfg):
        a = s.attempt(cv.attempt) if cv.attempt != NONE else None
        if cv.aphase is _A.FLUSHING and a is not None and a.required <= a.acks:
            b = _Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.COMMIT))
            b.attempt(cv.attempt, cas=Cas.IN_FLIGHT)
            yield b.step(f"commit(c{c})")


def compare_and_set(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane executes a compare-and-set that reached it."""
    for tau, a in enumerate(s.attempts, start=1):
        if a.cas is not Cas.IN_FLIGHT:
            continue
        b = _Builder(s)
        changes: dict[str, object] = {}
        if a.coord != s.epoch:
            reply = Reply.CONFLICT  # a replaced coordinator's commit raises conflict
        elif a.obsolete or a.expired:
            reply = Reply.FAILED if s.record == NONE else Reply.CONFLICT
        elif s.record == NONE:
            reply = Reply.SUCCEEDED
            changes = {"record": tau, "commit_epoch": s.epoch}
        else:
            reply = Reply.CONFLICT
        b.attempt(tau, cas=Cas.DONE, reply=reply)
        yield b.step(f"compare_and_set(t{tau})", **changes)


def commit_succeeded(s: State, cfg: Config) -> Iterator[Step]:
    """The record names ``(v+1, g)`` of the coordinator's attempt (reply or read_commit)."""
    for c, cv in _coords(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = _Builder(s)
        if (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.SUCCEEDED) or (
            cv.aphase is _A.RESOLVING and s.record == tau
        ):
            b.coord(
                c,
                aphase=b.go(cv.aphase, _X.COMMIT_SUCCEEDED),
                tphase=b.go(cv.tphase, _X.COMMIT_SUCCEEDED),
            )
        elif cv.tphase is _T.RESOLVING and s.record == tau:
            b.coord(c, tphase=b.go(cv.tphase, _X.COMMIT_SUCCEEDED))
        else:
            continue
        yield b.step(f"commit_succeeded(c{c})")


def commit_failed(s: State, cfg: Config) -> Iterator[Step]:
    """The record still holds ``K^v`` and no commit of the attempt can change it."""
    for c, cv in _coords(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = _Builder(s)
        if (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.FAILED) or (
            cv.aphase is _A.RESOLVING and s.record == NONE
        ):
            b.coord(
                c,
                aphase=b.go(cv.aphase, _X.COMMIT_FAILED),
                tphase=b.go(cv.tphase, _X.COMMIT_FAILED),
                overwrite=True,
            )
        elif cv.tphase is _T.RESOLVING and s.record == NONE:
            b.coord(c, tphase=b.go(cv.tphase, _X.COMMIT_FAILED), overwrite=True)
        else:
            continue
        yield b.step(f"commit_failed(c{c})")


def commit_unknown(s: State, cfg: Config) -> Iterator[Step]:
    """The coordinator got no reply: the request is still in flight or its reply was lost."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is _A.COMMITTING and (
            s.attempt(cv.attempt).cas is Cas.IN_FLIGHT or s.attempt(cv.attempt).reply is Reply.LOST
        ):
            b = _Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.COMMIT_UNKNOWN))
            yield b.step(f"commit_unknown(c{c})")


def read_commit(s: State, cfg: Config) -> Iterator[Step]:
    """Read the record once no commit of the attempt can change it (deadline or obsolete)."""
    for c, cv in _coords(s, cfg):
        tau = cv.attempt
        if tau == NONE:
            continue
        b = _Builder(s)
        if cv.aphase is _A.UNKNOWN and (s.attempt(tau).expired or s.attempt(tau).obsolete):
            b.coord(c, aphase=b.go(cv.aphase, _X.READ_COMMIT))
        elif cv.tphase is _T.TAKING_OVER and cv.aphase is _A.STOPPING and cv.stopped:
            b.coord(c, tphase=b.go(cv.tphase, _X.READ_COMMIT))
        else:
            continue
        yield b.step(f"read_commit(c{c})")


def conflict(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane raises conflict: this coordinator was replaced or lost the race."""
    for c, cv in _coords(s, replace(cfg, replaced_acts=True)):
        tau = cv.attempt
        lost_race = tau != NONE and (
            (cv.aphase is _A.COMMITTING and s.attempt(tau).reply is Reply.CONFLICT)
            or (cv.aphase is _A.RESOLVING and s.record not in (NONE, tau))
            or (cv.tphase is _T.RESOLVING and s.record not in (NONE, tau))
        )
        if not (lost_race or s.epoch != c) or (cv.tphase, _X.CONFLICT) not in _NEXT:
            continue
        b = _Builder(s)
        b.coord(c, tphase=b.go(cv.tphase, _X.CONFLICT))
        if b.may(cv.aphase, _X.CONFLICT):
            b.coord(c, aphase=b.go(cv.aphase, _X.CONFLICT))
        yield b.step(f"conflict(c{c})")


# -- failure and recovery (Algorithm B.2) ------------------------------------------------------


def fail(s: State, cfg: Config) -> Iterator[Step]:
    """An attempt fails: the coordinator gives up waiting, or a receiver rejects a payload.

    A receiver's report reaches its coordinator in the same step.  That loses no behaviour:
    every other endpoint's progress in between is independent of the failed receiver, so
    the search reaches the same combinations by running that progress first.
    """
    if s.budgets.failures == 0:
        return
    budgets = s.budgets._replace(failures=s.budgets.failures - 1)
    for c, cv in _coords(s, cfg):
        if cv.aphase in _ATTEMPT_RUNNING:
            b = _Builder(s)
            _fail_attempt(b, c, cv)
            yield b.step(f"fail(c{c})", budgets=budgets)
    for r, rx in enumerate(s.receivers):
        if rx.phase in _RECEIVER_RUNNING:
            b = _Builder(s)
            b.receiver(r, phase=b.go(rx.phase, _X.FAIL))
            _notice(b, s, cfg, r)
            yield b.step(f"fail(r{r})", budgets=budgets)


def _fail_attempt(b: _Builder, c: int, cv: CoordVar) -> None:
    b.coord(c, aphase=b.go(cv.aphase, _X.FAIL))
    _fail_transition(b, c, cv, _X.FAIL)


def _notice(b: _Builder, s: State, cfg: Config, r: int) -> None:
    """Coordinators whose running attempt requires receiver ``r`` fail that attempt."""
    for c, cv in _coords(s, cfg):
        if cv.aphase in _ATTEMPT_RUNNING and any(x == r for x, _ in s.attempt(cv.attempt).required):
            _fail_attempt(b, c, cv)


def reject(s: State, cfg: Config) -> Iterator[Step]:
    """A prepare check fails before admission: the transition ends with ``v`` committed."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is _A.PREPARING and cv.tphase is _T.ADMITTING:
            b = _Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.REJECT), tphase=b.go(cv.tphase, _X.REJECT))
            yield b.step(f"reject(c{c})")


def mark_obsolete(s: State, cfg: Config) -> Iterator[Step]:
    """The control plane refuses the attempt's commit; endpoints ignore its later payloads."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is not _A.FAILED:
            continue
        tau = cv.attempt
        b = _Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.MARK_OBSOLETE))
        b.attempt(tau, obsolete=True)
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and b.may(ow.phase, _X.MARK_OBSOLETE):
                b.owner(o, phase=b.go(ow.phase, _X.MARK_OBSOLETE))
        for r in _live(s, tau):
            rx = s.receivers[r]
            b.receiver(r, epoch=max(rx.epoch, c))
            if rx.attempt == tau and b.may(rx.phase, _X.MARK_OBSOLETE):
                b.receiver(r, phase=b.go(rx.phase, _X.MARK_OBSOLETE))
        yield b.step(f"mark_obsolete(c{c})")


def stop_and_wait(s: State, cfg: Config) -> Iterator[Step]:
    """Surviving endpoints drain the attempt's writes; crashed receivers are retired."""
    for c, cv in _coords(s, cfg):
        if cv.aphase is not _A.OBSOLETE:
            continue
        tau = cv.attempt
        b = _Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.STOP_AND_WAIT), stopped=True)
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and ow.phase is _O.OBSOLETE:
                b.owner(o, phase=b.go(ow.phase, _X.STOP_AND_WAIT))
        for r, rx in enumerate(s.receivers):
            if rx.attempt == tau and rx.phase is _R.OBSOLETE:
                b.receiver(r, phase=b.go(rx.phase, _X.STOP_AND_WAIT))
        yield b.step(f"stop_and_wait(c{c})")


def cleanup(s: State, cfg: Config) -> Iterator[Step]:
    """Release the attempt; then retry, end, finish the commit, or wait for dense refits."""
    for c, cv in _coords(s, cfg):
        tau = cv.attempt
        b = _Builder(s)
        if cv.tphase is _T.FINISHING:
            if cv.reported != frozenset(range(len(s.owners))):
                continue
            b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
        elif cv.tphase in (_T.READMITTING, _T.RECOVERING, _T.REJECTING, _T.ABORTING):
            if cv.aphase is _A.CLEANED and cv.tphase is _T.ABORTING:
                b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
                yield b.step(f"cleanup(c{c})")
                continue
            if cv.aphase is not _A.STOPPING:
                continue
            if cv.tphase in (_T.REJECTING, _T.ABORTING):
                b.coord(c, tphase=b.go(cv.tphase, _X.CLEANUP))
        else:
            continue
        b.coord(c, aphase=b.go(cv.aphase, _X.CLEANUP))
        for o, ow in enumerate(s.owners):
            if ow.attempt == tau and ow.phase in (_O.STOPPED, _O.UPDATED):
                b.owner(o, phase=b.go(ow.phase, _X.CLEANUP))
        for r, rx in enumerate(s.receivers):
            if rx.attempt == tau and rx.phase in (_R.STOPPED, _R.ACKED):
                b.receiver(r, phase=b.go(rx.phase, _X.CLEANUP))
        yield b.step(f"cleanup(c{c})")


def baseline_update(s: State, cfg: Config) -> Iterator[Step]:
    """An owner reads ``(v+1, g)``, updates its baseline in place and reports (repeatable)."""
    for c, cv in _coords(s, cfg):
        if cv.tphase is not _T.FINISHING or s.record == NONE:
            continue
        for o, ow in enumerate(s.owners):
            if o in cv.reported or (ow.phase, _X.BASELINE_UPDATE) not in _NEXT:
                continue
            b = _Builder(s)
            b.owner(o, phase=b.go(ow.phase, _X.BASELINE_UPDATE), baseline=V1)
            b.coord(c, tphase=b.go(cv.tphase, _X.BASELINE_UPDATE), reported=cv.reported | {o})
            yield b.step(f"baseline_update(o{o},c{c})")


def reopen_gate(s: State, cfg: Config) -> Iterator[Step]:
    """Receivers drop KV caches and reopen the gate (after commit, or after dense refits)."""
    for c, cv in _coords(s, cfg):
        b = _Builder(s)
        if cv.tphase is _T.REOPENING:
            b.coord(c, tphase=b.go(cv.tphase, _X.REOPEN_GATE))
            for r, rx in enumerate(s.receivers):
                # A replaced coordinator's gate call is ignored; a receiver reopens only at a
                # record it holds (it acknowledged the committed attempt).
                if (
                    rx.attempt == cv.attempt
                    and rx.phase is _R.CLEANED
                    and rx.epoch <= c
                    and rx.acked == s.record != NONE
                ):
                    b.receiver(
                        r, phase=b.go(rx.phase, _X.REOPEN_GATE), gate_open=True, kv=EMPTY, held=V1
                    )
        elif cv.tphase is _T.REFITTING:
            # Receivers where writes landed are dense-refitted first; the others hold the
            # committed record and reopen at once.
            if any(rx.phase is _R.CLEANED and _dirty(rx) for rx in s.receivers):
                continue
            b.coord(c, tphase=b.go(cv.tphase, _X.REOPEN_GATE))
            for r, rx in enumerate(s.receivers):
                if (
                    rx.attempt == cv.attempt
                    and rx.phase in (_R.CLEANED, _R.REFITTED)
                    and rx.held == s.record_version
                    and not _dirty(rx)
                    and rx.epoch <= c
                ):
                    b.receiver(r, phase=b.go(rx.phase, _X.REOPEN_GATE), gate_open=True, kv=EMPTY)
        else:
            continue
        yield b.step(f"reopen_gate(c{c})")


def take_over(s: State, cfg: Config) -> Iterator[Step]:
    """The next coordinator replaces the active one and adopts its last registered attempt."""
    if s.budgets.failovers == 0 or s.coords[s.epoch - 1].tphase in _TERMINAL:
        return
    c = s.epoch + 1
    fresh = s.coords[c - 1]
    b = _Builder(s)
    budgets = s.budgets._replace(failovers=s.budgets.failovers - 1)
    if s.registered == NONE:
        b.coord(c, started=True)
    else:
        b.coord(
            c,
            started=True,
            tphase=b.go(fresh.tphase, _X.TAKE_OVER),
            aphase=b.go(fresh.aphase, _X.TAKE_OVER),
            attempt=s.registered,
            overwrite=True,
            admitted=True,
        )
    if not cfg.replaced_acts:
        # The replaced coordinator learns of the takeover at once and stands down; only its
        # commit already in flight can still reach the control plane.
        old = s.coords[s.epoch - 1]
        if b.may(old.tphase, _X.CONFLICT):
            b.coord(s.epoch, tphase=b.go(old.tphase, _X.CONFLICT))
        if b.may(old.aphase, _X.CONFLICT):
            b.coord(s.epoch, aphase=b.go(old.aphase, _X.CONFLICT))
    yield b.step(f"take_over(c{c})", epoch=c, budgets=budgets)


def abort(s: State, cfg: Config) -> Iterator[Step]:
    """The operator aborts; not while a commit outcome is pending (it is resolved first)."""
    if s.budgets.aborts == 0:
        return
    for c, cv in _coords(s, cfg):
        if s.epoch != c or (cv.tphase, _X.ABORT) not in _NEXT:
            continue
        if cv.aphase in (_A.COMMITTING, _A.UNKNOWN, _A.RESOLVING, _A.COMMITTED):
            continue
        b = _Builder(s)
        b.coord(c, tphase=b.go(cv.tphase, _X.ABORT))
        if cv.aphase in _ATTEMPT_RUNNING:
            b.coord(c, aphase=b.go(cv.aphase, _X.FAIL))
        yield b.step(f"abort(c{c})", budgets=s.budgets._replace(aborts=s.budgets.aborts - 1))


def dense_refit(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver restores the committed version by a dense load and prewarm."""
    refitting = [c for c, cv in _coords(s, cfg) if cv.tphase is _T.REFITTING]
    for r, rx in enumerate(s.receivers):
        stale = rx.phase is _R.REFITTED and rx.held != s.record_version
        aborted = rx.phase is _R.CLEANED and _dirty(rx) and bool(refitting)
        if not (rx.phase is _R.JOINING or stale or aborted):
            continue
        b = _Builder(s)
        b.receiver(
            r,
            phase=b.go(rx.phase, _X.DENSE_REFIT),
            storage=(s.record_version,) * len(s.owners),
            held=s.record_version,
            kv=EMPTY,
            gate_open=False,
            staged=frozenset(),
            applied=frozenset(),
            acked=NONE,
        )
        if aborted:
            for c in refitting:
                b.coord(c, tphase=b.go(s.coords[c - 1].tphase, _X.DENSE_REFIT))
        yield b.step(f"dense_refit(r{r})")


# -- environment -------------------------------------------------------------------------------


def crash_receiver(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver process dies; its replacement starts JOINING with unknown storage."""
    if s.budgets.crashes == 0:
        return
    for r, rx in enumerate(s.receivers):
        if rx.phase is _R.JOINING:
            continue
        b = _Builder(s)
        b.receiver(
            r,
            phase=_R.JOINING,
            attempt=NONE,
            inc=rx.inc + 1,
            gate_open=False,
            kv=EMPTY,
            storage=(LOST,) * len(s.owners),
            staged=frozenset(),
            applied=frozenset(),
            held=EMPTY,
            epoch=0,
            acked=NONE,
        )
        _notice(b, s, cfg, r)
        yield b.step(
            f"crash_receiver(r{r})",
            inflight=frozenset(p for p in s.inflight if p.receiver != r),
            budgets=s.budgets._replace(crashes=s.budgets.crashes - 1),
        )


def lose_payload(s: State, cfg: Config) -> Iterator[Step]:
    if s.budgets.losses == 0:
        return
    budgets = s.budgets._replace(losses=s.budgets.losses - 1)
    for p in sorted(s.inflight, key=_payload_key):
        yield Step(
            f"lose_payload(t{p.attempt},o{p.range},r{p.receiver})",
            replace(s, inflight=s.inflight - {p}, budgets=budgets),
            (),
        )


def duplicate_payload(s: State, cfg: Config) -> Iterator[Step]:
    """The transport delivers an already ingested payload again."""
    if s.budgets.duplicates == 0:
        return
    budgets = s.budgets._replace(duplicates=s.budgets.duplicates - 1)
    for r, rx in enumerate(s.receivers):
        if rx.attempt == NONE or rx.phase not in _RECEIVER_RUNNING:
            continue
        a = s.attempt(rx.attempt)
        for x, enc in sorted(rx.staged) + [(x, _encoding(s, a, x)) for x in sorted(rx.applied)]:
            p = Payload(rx.attempt, x, r, enc)
            if p not in s.inflight:
                yield Step(
                    f"duplicate_payload(t{p.attempt},o{x},r{r})",
                    replace(s, inflight=s.inflight | {p}, budgets=budgets),
                    (),
                )


def lose_commit_reply(s: State, cfg: Config) -> Iterator[Step]:
    """The reply to a compare-and-set is lost before its coordinator reads it."""
    if s.budgets.reply_losses == 0:
        return
    for tau, a in enumerate(s.attempts, start=1):
        if a.reply in (Reply.SUCCEEDED, Reply.FAILED, Reply.CONFLICT) and _awaits_outcome(s, tau):
            b = _Builder(s)
            b.attempt(tau, reply=Reply.LOST)
            yield b.step(
                f"lose_commit_reply(t{tau})",
                budgets=s.budgets._replace(reply_losses=s.budgets.reply_losses - 1),
            )


def expire_deadline(s: State, cfg: Config) -> Iterator[Step]:
    """The commit deadline of an attempt passes; the control plane refuses its commit after."""
    for tau, a in enumerate(s.attempts, start=1):
        if a.cas is not Cas.NONE and not a.expired and _awaits_outcome(s, tau):
            b = _Builder(s)
            b.attempt(tau, expired=True)
            yield b.step(f"expire_deadline(t{tau})")


def _dirty(rx: ReceiverVar) -> bool:
    """Writes of some attempt landed since the receiver held a committed version."""
    return any(v != rx.held for v in rx.storage)


def _awaits_outcome(s: State, tau: int) -> bool:
    """Some coordinator still waits for the commit outcome of ``tau`` (else time is moot)."""
    return any(
        c.started and c.attempt == tau and c.aphase in (_A.COMMITTING, _A.UNKNOWN) for c in s.coords
    )


_TERMINAL = frozenset({_T.COMMITTED, _T.REJECTED, _T.ABORTED, _T.STOOD_DOWN})


def _payload_key(p: Payload) -> tuple[int, int, int, int]:
    return (p.attempt, p.range, p.receiver, int(p.encoding))


def _encoding(s: State, a: AttemptVar, owner: int) -> Encoding:
    if a.overwrite:
        return Encoding.OVERWRITE
    return Encoding.XOR_V0 if s.owners[owner].baseline == V0 else Encoding.XOR_V1


ACTIONS: dict[str, Action] = {
    "prepare": prepare,
    "reject": reject,
    "send": send,
    "ingest": ingest,
    "wait_for_requests": wait_for_requests,
    "open_apply": open_apply,
    "apply": apply,
    "flush": flush,
    "ack": ack,
    "commit": commit,
    "commit_succeeded": commit_succeeded,
    "commit_failed": commit_failed,
    "commit_unknown": commit_unknown,
    "conflict": conflict,
    "read_commit": read_commit,
    "fail": fail,
    "mark_obsolete": mark_obsolete,
    "stop_and_wait": stop_and_wait,
    "cleanup": cleanup,
    "baseline_update": baseline_update,
    "reopen_gate": reopen_gate,
    "take_over": take_over,
    "abort": abort,
    "dense_refit": dense_refit,
    "compare_and_set": compare_and_set,
    "expire_deadline": expire_deadline,
    "lose_commit_reply": lose_commit_reply,
    "lose_payload": lose_payload,
    "duplicate_payload": duplicate_payload,
    "crash_receiver": crash_receiver,
}
"""Every action of the specification, by name (the TLA+ name in snake case)."""

ENVIRONMENT = frozenset(
    {
        "compare_and_set",
        "expire_deadline",
        "lose_commit_reply",
        "lose_payload",
        "duplicate_payload",
        "crash_receiver",
    }
)
"""Actions of the control plane and the environment rather than protocol triggers."""
