"""Exhaustive breadth-first model checking of the Python mirror of ``models/refit.tla``.

The search keeps a parent pointer for every distinct state, so the first violation it meets
comes with a shortest trace from the initial state.  Receivers are interchangeable, so states
are stored in a canonical receiver order (symmetry reduction); traces are replayed with the
concrete receiver names.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from dcr.protocol.lifecycle import AnyEdge
from dcr.testing.spec.actions import ACTIONS, Action, Config, Step, initial_state
from dcr.testing.spec.invariants import INVARIANTS, Invariant
from dcr.testing.spec.state import Payload, ReceiverVar, State

__all__ = ["Counterexample", "Result", "canonical", "explore", "successors"]


@dataclass(frozen=True, slots=True)
class Counterexample:
    """A shortest trace from the initial state to a state that violates ``invariant``."""

    invariant: str
    message: str
    trace: tuple[Step, ...]

    def __str__(self) -> str:
        lines = [f"invariant {self.invariant} violated after {len(self.trace)} steps: {self.message}"]
        lines += [f"  {i + 1:3d}. {step.label}" for i, step in enumerate(self.trace)]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Result:
    """What one exhaustive search found."""

    states: int
    """Distinct states (up to receiver symmetry)."""
    transitions: int
    depth: int
    """Length of the longest shortest path (the diameter the search reached)."""
    edges: frozenset[AnyEdge]
    """Edges of the lifecycle table that some explored step took."""
    actions: frozenset[str]
    """Actions that were enabled somewhere."""
    violation: Counterexample | None
    seconds: float
    complete: bool
    """False when ``max_states`` stopped the search early."""


def successors(s: State, cfg: Config, actions: Mapping[str, Action] = ACTIONS) -> list[Step]:
    """Every step any action allows from ``s``."""
    return [step for action in actions.values() for step in action(s, cfg)]


def _receiver_key(s: State, r: int) -> tuple[object, ...]:
    rx = s.receivers[r]
    return (
        _var_key(rx),
        tuple(
            (any(x == r for x, _ in a.required), any(x == r for x, _ in a.acks))
            for a in s.attempts
        ),
        tuple(sorted((p.attempt, p.range, int(p.encoding)) for p in s.inflight if p.receiver == r)),
    )


def _var_key(rx: ReceiverVar) -> tuple[object, ...]:
    return (
        rx.phase.value,
        rx.attempt,
        rx.inc,
        rx.gate_open,
        rx.kv,
        rx.storage,
        tuple(sorted((x, int(e)) for x, e in rx.staged)),
        tuple(sorted(rx.applied)),
        rx.held,
        rx.epoch,
        rx.acked,
    )


def canonical(s: State) -> State:
    """``s`` with receivers renumbered into a canonical order (receivers are symmetric)."""
    n = len(s.receivers)
    order = sorted(range(n), key=lambda r: _receiver_key(s, r))  # type: ignore[arg-type, return-value]
    if order == list(range(n)):
        return s
    new = {old: i for i, old in enumerate(order)}
    return replace(
        s,
        receivers=tuple(s.receivers[old] for old in order),
        attempts=tuple(
            replace(
                a,
                required=frozenset((new[r], inc) for r, inc in a.required),
                acks=frozenset((new[r], inc) for r, inc in a.acks),
            )
            for a in s.attempts
        ),
        inflight=frozenset(
            Payload(p.attempt, p.range, new[p.receiver], p.encoding) for p in s.inflight
        ),
    )


def explore(
    cfg: Config,
    *,
    actions: Mapping[str, Action] = ACTIONS,
    invariants: Mapping[str, Invariant] = INVARIANTS,
    max_states: int | None = None,
    max_depth: int | None = None,
    symmetry: bool = True,
) -> Result:
    """Breadth-first search of every reachable state; stops at the first violation."""
    started = time.perf_counter()
    norm = canonical if symmetry else (lambda s: s)
    init = norm(initial_state(cfg))
    parent: dict[State, tuple[State, str] | None] = {init: None}
    depth_of = {init: 0}
    queue = deque([init])
    edges: set[AnyEdge] = set()
    enabled: set[str] = set()
    transitions = 0
    depth = 0

    def result(violation: Counterexample | None, complete: bool) -> Result:
        return Result(
            states=len(parent),
            transitions=transitions,
            depth=depth,
            edges=frozenset(edges),
            actions=frozenset(enabled),
            violation=violation,
            seconds=time.perf_counter() - started,
            complete=complete,
        )

    bad = _check(init, invariants)
    if bad:
        return result(Counterexample(bad[0], bad[1], ()), True)
    while queue:
        s = queue.popleft()
        d = depth_of[s]
        if max_depth is not None and d >= max_depth:
            continue
        for name, action in actions.items():
            for step in action(s, cfg):
                transitions += 1
                enabled.add(name)
                edges.update(step.edges)
                t = norm(step.state)
                if t in parent:
                    continue
                parent[t] = (s, step.label)
                depth_of[t] = d + 1
                depth = max(depth, d + 1)
                bad = _check(t, invariants)
                if bad:
                    trace = _replay(_chain(parent, t), cfg, actions, norm)
                    return result(Counterexample(bad[0], bad[1], trace), True)
                if max_states is not None and len(parent) >= max_states:
                    return result(None, False)
                queue.append(t)
    return result(None, True)


def _check(s: State, invariants: Mapping[str, Invariant]) -> tuple[str, str] | None:
    for name, check in invariants.items():
        msg = check(s)
        if msg is not None:
            return name, msg
    return None


def _chain(parent: Mapping[State, tuple[State, str] | None], t: State) -> list[State]:
    chain = [t]
    while (link := parent[chain[-1]]) is not None:
        chain.append(link[0])
    return chain[::-1]


def _replay(
    chain: list[State], cfg: Config, actions: Mapping[str, Action], norm: object
) -> tuple[Step, ...]:
    """Concrete steps whose canonical states follow ``chain`` (receiver names made consistent)."""
    assert callable(norm)
    state = initial_state(cfg)
    steps: list[Step] = []
    for target in chain[1:]:
        step = next(st for st in successors(state, cfg, actions) if norm(st.state) == target)
        steps.append(step)
        state = step.state
    return tuple(steps)
