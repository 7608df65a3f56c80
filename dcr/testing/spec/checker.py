"""Exhaustive breadth-first model checking of the Python mirrors of ``models/refit.tla``
(one transition) and ``models/membership.tla`` (runs of several transitions).

The search keeps a parent pointer for every distinct state, so the first violation it meets
comes with a shortest trace from the initial state.  Receivers are interchangeable, so states
are stored in a canonical receiver order (symmetry reduction); traces are replayed with the
concrete receiver names.  A :class:`Model` names what the search needs of a specification;
:data:`TRANSITION` is the one-transition model, the default.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from dcr.protocol.lifecycle import AnyEdge, ReceiverPhase
from dcr.testing.spec.actions import ACTIONS
from dcr.testing.spec.invariants import INVARIANTS
from dcr.testing.spec.memo import evolve, memo
from dcr.testing.spec.state import AttemptVar, Payload, ReceiverVar, State
from dcr.testing.spec.steps import Action, Config, Step, initial_state

__all__ = [
    "TRANSITION",
    "AnyStep",
    "Counterexample",
    "Model",
    "Result",
    "canonical",
    "explore",
    "renumber",
    "successors",
]


class AnyStep(Protocol):
    """One successor of any model: the action's label, the new state, the edges it took."""

    @property
    def label(self) -> str: ...

    @property
    def state(self) -> Any: ...

    @property
    def edges(self) -> tuple[AnyEdge, ...]: ...


@dataclass(frozen=True, slots=True)
class Model:
    """What the search needs of a specification: its initial state for a configuration, its
    actions (each yields steps), its invariants and its symmetry reduction."""

    initial: Callable[[Any], Hashable]
    actions: Mapping[str, Callable[[Any, Any], Iterable[AnyStep]]]
    invariants: Mapping[str, Callable[[Any], str | None]]
    canonical: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Counterexample:
    """A shortest trace from the initial state to a state that violates ``invariant``."""

    invariant: str
    message: str
    trace: tuple[AnyStep, ...]

    def __str__(self) -> str:
        head = f"invariant {self.invariant} violated after {len(self.trace)} steps"
        lines = [f"{head}: {self.message}"]
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


_PHASE_INDEX = {p: i for i, p in enumerate(ReceiverPhase)}


def _receiver_key(rx: ReceiverVar) -> tuple[object, ...]:
    return (
        _PHASE_INDEX[rx.phase],
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


def _members(attempts: tuple[AttemptVar, ...], n: int) -> list[int]:
    """Per receiver: bits of the attempts that require it and that hold its ACK."""
    member = [0] * n
    for i, a in enumerate(attempts):
        for r, _ in a.required:
            member[r] |= 1 << (2 * i)
        for r, _ in a.acks:
            member[r] |= 1 << (2 * i + 1)
    return member


def _mail(inflight: frozenset[Payload], n: int) -> list[tuple[tuple[int, int, int], ...]]:
    """Per receiver: the payloads in flight to it, sorted."""
    mail: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for p in inflight:
        mail[p.receiver].append((p.attempt, p.range, int(p.encoding)))
    return [tuple(sorted(m)) for m in mail]


def _renumber_attempts(
    attempts: tuple[AttemptVar, ...], new: dict[int, int]
) -> tuple[AttemptVar, ...]:
    return tuple(
        a._replace(
            required=frozenset((new[r], inc) for r, inc in a.required),
            acks=frozenset((new[r], inc) for r, inc in a.acks),
        )
        for a in attempts
    )


def _renumber_inflight(inflight: frozenset[Payload], new: dict[int, int]) -> frozenset[Payload]:
    return frozenset(Payload(p.attempt, p.range, new[p.receiver], p.encoding) for p in inflight)


def canonical(s: State) -> State:
    """``s`` with receivers renumbered into a canonical order (receivers are symmetric).

    Receivers are sorted by everything that concerns them: their own variables, the
    attempts that require them or hold their ACKs, and the payloads in flight to them.
    """
    n = len(s.receivers)
    member = memo(("members", s.attempts, n), lambda: _members(s.attempts, n))
    mail = memo(("mail", s.inflight, n), lambda: _mail(s.inflight, n))
    keys = [
        (memo(("receiver", rx), partial(_receiver_key, rx)), member[r], mail[r])
        for r, rx in enumerate(s.receivers)
    ]
    order = tuple(sorted(range(n), key=keys.__getitem__))
    if order == tuple(range(n)):
        return s
    return renumber(s, order)


def renumber(s: State, order: tuple[int, ...]) -> State:
    """``s`` with receiver ``order[i]`` renamed ``i``."""
    new = {old: i for i, old in enumerate(order)}
    return evolve(
        s,
        attempts=memo(("attempts", s.attempts, order), lambda: _renumber_attempts(s.attempts, new)),
        receivers=tuple(s.receivers[old] for old in order),
        inflight=memo(("inflight", s.inflight, order), lambda: _renumber_inflight(s.inflight, new)),
    )


def explore(
    cfg: Any,
    *,
    model: Model | None = None,
    actions: Mapping[str, Callable[[Any, Any], Iterable[AnyStep]]] | None = None,
    invariants: Mapping[str, Callable[[Any], str | None]] | None = None,
    max_states: int | None = None,
    max_depth: int | None = None,
    symmetry: bool = True,
) -> Result:
    """Breadth-first search of every reachable state of ``model`` (default :data:`TRANSITION`)
    at ``cfg``; stops at the first violation.  ``actions`` and ``invariants`` replace the
    model's own (a broken mirror, say)."""
    m = model if model is not None else TRANSITION
    actions = m.actions if actions is None else actions
    invariants = m.invariants if invariants is None else invariants
    initial = m.initial
    started = time.perf_counter()
    norm = m.canonical if symmetry else (lambda s: s)
    init = norm(initial(cfg))
    parent: dict[Any, tuple[Any, str] | None] = {init: None}
    queue = deque([(init, 0)])
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
        s, d = queue.popleft()
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
                if d + 1 > depth:
                    depth = d + 1
                bad = _check(t, invariants)
                if bad:
                    trace = _replay(_chain(parent, t), cfg, initial, actions, norm)
                    return result(Counterexample(bad[0], bad[1], trace), True)
                if max_states is not None and len(parent) >= max_states:
                    return result(None, False)
                queue.append((t, d + 1))
    return result(None, True)


def _check(s: Any, invariants: Mapping[str, Callable[[Any], str | None]]) -> tuple[str, str] | None:
    for name, check in invariants.items():
        msg = check(s)
        if msg is not None:
            return name, msg
    return None


def _chain(parent: Mapping[Any, tuple[Any, str] | None], t: Any) -> list[Any]:
    chain = [t]
    while (link := parent[chain[-1]]) is not None:
        chain.append(link[0])
    return chain[::-1]


def _replay(
    chain: list[Any],
    cfg: Any,
    initial: Callable[[Any], Any],
    actions: Mapping[str, Callable[[Any, Any], Iterable[AnyStep]]],
    norm: Callable[[Any], Any],
) -> tuple[AnyStep, ...]:
    """Concrete steps whose canonical states follow ``chain`` (receiver names made consistent)."""
    state = initial(cfg)
    steps: list[AnyStep] = []
    for target in chain[1:]:
        step = next(
            st
            for action in actions.values()
            for st in action(state, cfg)
            if norm(st.state) == target
        )
        steps.append(step)
        state = step.state
    return tuple(steps)


TRANSITION = Model(
    initial=initial_state, actions=ACTIONS, invariants=INVARIANTS, canonical=canonical
)
"""The model of one transition ``v -> v+1`` (``models/refit.tla``)."""
