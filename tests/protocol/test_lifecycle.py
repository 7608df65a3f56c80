"""The edge table and the typed state-machine wrapper (h2-style tests over all pairs)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcr.errors import LocalProtocolError
from dcr.protocol.lifecycle import (
    EDGES,
    LIFECYCLES,
    AttemptPhase,
    Phase,
    ReceiverPhase,
    TransitionPhase,
    Trigger,
    edges_of,
    initial_phase,
    terminal_phases,
)
from dcr.protocol.machine import StateMachine


def test_table_is_deterministic_and_typed() -> None:
    seen: dict[tuple[Phase, Trigger], Phase] = {}
    for e in EDGES:
        assert type(e.source) is type(e.dest), e
        assert isinstance(e.trigger, Trigger)
        assert (e.source, e.trigger) not in seen, f"two destinations for {e.source}/{e.trigger}"
        seen[(e.source, e.trigger)] = e.dest
    assert len(seen) == len(EDGES)


@pytest.mark.parametrize("lifecycle", LIFECYCLES, ids=lambda lc: lc.__name__)
def test_every_phase_is_reachable_from_the_initial_one(lifecycle: type[Phase]) -> None:
    starts = {initial_phase(lifecycle)}  # type: ignore[type-var]
    if lifecycle is ReceiverPhase:
        starts.add(ReceiverPhase.JOINING)  # a restarted receiver
    reached, queue = set(starts), deque(starts)
    while queue:
        p = queue.popleft()
        for e in edges_of(lifecycle):  # type: ignore[type-var]
            if e.source == p and e.dest not in reached:
                reached.add(e.dest)
                queue.append(e.dest)
    assert reached == set(lifecycle)


def test_terminal_phases_are_the_documented_outcomes() -> None:
    assert terminal_phases(TransitionPhase) == {
        TransitionPhase.COMMITTED,
        TransitionPhase.REJECTED,
        TransitionPhase.ABORTED,
        TransitionPhase.STOOD_DOWN,
    }
    assert terminal_phases(AttemptPhase) == {AttemptPhase.CLEANED, AttemptPhase.ABANDONED}


def test_every_trigger_labels_an_edge() -> None:
    assert {e.trigger for e in EDGES} == set(Trigger)


pairs = st.sampled_from(LIFECYCLES).flatmap(
    lambda lc: st.tuples(st.just(lc), st.sampled_from(list(lc)), st.lists(st.sampled_from(Trigger)))
)


@given(pairs)
def test_each_trigger_steps_legally_or_raises_and_changes_nothing(
    case: tuple[type[Phase], Phase, list[Trigger]],
) -> None:
    lifecycle, start, triggers = case
    table = {(e.source, e.trigger): e.dest for e in edges_of(lifecycle)}  # type: ignore[type-var]
    m = StateMachine(lifecycle, name="under test", initial=start)  # type: ignore[type-var]
    for trigger in triggers:
        before = m.phase
        expected = table.get((before, trigger))
        assert m.can_fire(trigger) == (expected is not None)
        if expected is None:
            with pytest.raises(LocalProtocolError) as info:
                m.fire(trigger)
            assert info.value.check == "transition"
            assert m.phase == before
        else:
            assert m.fire(trigger) == expected
            assert m.phase == expected


def test_all_state_trigger_pairs() -> None:
    """Exhaustive version of the property above: every (phase, trigger) pair, once."""
    for lifecycle in LIFECYCLES:
        table = {(e.source, e.trigger): e.dest for e in edges_of(lifecycle)}  # type: ignore[type-var]
        for phase in lifecycle:
            for trigger in Trigger:
                m = StateMachine(lifecycle, name="pair", initial=phase)  # type: ignore[type-var]
                if (phase, trigger) in table:
                    assert m.fire(trigger) == table[(phase, trigger)]
                else:
                    with pytest.raises(LocalProtocolError):
                        m.fire(trigger)
                    assert m.phase == phase


def test_a_refusing_guard_raises_and_leaves_the_phase() -> None:
    allowed = {"ok": False}

    def guard(*, why: str = "") -> str | None:
        return None if allowed["ok"] else f"not yet {why}"

    m = StateMachine(AttemptPhase, name="attempt 7", attempt=7, initial=AttemptPhase.FLUSHING,
                     guards={Trigger.COMMIT: guard})  # fmt: skip
    assert not m.can_fire(Trigger.COMMIT)
    with pytest.raises(LocalProtocolError) as info:
        m.fire(Trigger.COMMIT, why="acks missing")
    assert info.value.check == "guard" and info.value.attempt == 7
    assert "not yet acks missing" in str(info.value)
    assert m.phase is AttemptPhase.FLUSHING
    allowed["ok"] = True
    assert m.fire(Trigger.COMMIT) is AttemptPhase.COMMITTING


def test_no_back_doors_on_the_machine() -> None:
    m = StateMachine(TransitionPhase, name="t")
    model = m._model
    assert not [a for a in dir(model) if not a.startswith("_") and a != "phase"]
    assert not hasattr(m, "to_committed")
    assert not any(name.startswith("to_") for name in m._machine.events)
