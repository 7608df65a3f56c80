"""The projection of a protocol world into the specification: the
:class:`~dcr.testing.spec.state.State` the real cores are in, so that the model's invariants
(:mod:`dcr.testing.spec.invariants`) judge the real cores after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcr.protocol.lifecycle import AttemptPhase, TransitionPhase
from dcr.protocol.types import CommitRecord, Mode
from dcr.testing.spec.state import (
    EMPTY,
    NONE,
    V0,
    V1,
    AttemptVar,
    Budgets,
    Cas,
    CoordVar,
    OwnerVar,
    ReceiverVar,
    Reply,
    State,
)

if TYPE_CHECKING:
    from dcr.testing.protocol_world import World

__all__ = ["project"]


def project(world: World) -> State:
    """The specification state this world is in (for the shared invariants)."""
    taus = sorted(world.infos)
    index = {tau: i + 1 for i, tau in enumerate(taus)}
    record = NONE
    if world.record != world.base:
        record = next(
            (index[t] for t in taus if world.infos[t].target == world.record), len(taus) + 1
        )
    coords = []
    for epoch in range(1, max(world.coordinators, default=0) + 1):
        core = world.coordinators.get(epoch)
        if core is None:
            coords.append(
                CoordVar(
                    False,
                    TransitionPhase.IDLE,
                    AttemptPhase.PLANNED,
                    NONE,
                    False,
                    False,
                    frozenset(),
                    False,
                )
            )
            continue
        info = core.attempt
        coords.append(
            CoordVar(
                started=True,
                tphase=core.phase,
                aphase=core.attempt_phase or AttemptPhase.PLANNED,
                attempt=index.get(info.attempt, NONE) if info else NONE,
                overwrite=core.mode is Mode.OVERWRITE,
                admitted=core.admitted,
                reported=frozenset(world.owner_names.index(o) for o in core.reported),
                stopped=False,
            )
        )
    attempts = tuple(
        AttemptVar(
            coord=world.infos[t].coordinator,
            overwrite=world.infos[t].mode is Mode.OVERWRITE,
            required=world.required[t],
            acks=frozenset(world.acks.get(t, ())),
            obsolete=t in world.obsolete,
            cas=world.cas.get(t, Cas.NONE),
            reply=world.replies.get(t, Reply.NONE),
            expired=t in world.expired,
        )
        for t in taus
    )
    owners = tuple(
        OwnerVar(
            phase=w.core.phase,
            attempt=index.get(w.core.attempt.attempt, NONE) if w.core.attempt else NONE,
            baseline=w.baseline,
            sent=bool(w.core.sent),
        )
        for w in world.owners.values()
    )
    receivers = tuple(
        ReceiverVar(
            phase=rx.core.phase,
            attempt=index.get(rx.core.attempt.attempt, NONE) if rx.core.attempt else NONE,
            inc=rx.inc,
            gate_open=rx.gate_open,
            kv=rx.kv,
            storage=tuple(rx.storage[rng] for rng in world.ranges),
            staged=frozenset(),
            applied=frozenset(),
            held=_version(world, rx.core.held),
            epoch=0,
            acked=NONE,
        )
        for rx in world.receivers.values()
    )
    if record > len(taus):
        world.problems.append(f"the record names {world.record}, which no attempt prepared")
    return State(
        record=record,
        commit_epoch=world.commit_epoch,
        epoch=world.epoch,
        registered=index.get(world.registered.attempt, NONE) if world.registered else NONE,
        coords=tuple(coords),
        attempts=attempts,
        owners=owners,
        receivers=receivers,
        inflight=frozenset(),
        budgets=Budgets(),
    )


def _version(world: World, record: CommitRecord | None) -> int:
    if record is None:
        return EMPTY
    return V0 if record == world.base else V1
