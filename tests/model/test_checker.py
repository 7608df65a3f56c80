"""Exhaustive breadth-first checking of the mirror of models/refit.tla."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from dcr.protocol.lifecycle import EDGES, AnyEdge, Edge, ReceiverPhase, Trigger
from dcr.testing.spec import commit, recovery, streaming
from dcr.testing.spec.actions import ACTIONS
from dcr.testing.spec.checker import Result, explore
from dcr.testing.spec.configs import COVERAGE, HEAVY, REQUIRED
from dcr.testing.spec.state import Cas, State
from dcr.testing.spec.steps import Action, Config, Step

_results: dict[str, Result] = {}


def result(name: str) -> Result:
    """Each coverage configuration is explored once per session."""
    if name not in _results:
        _results[name] = explore(COVERAGE[name])
    return _results[name]


def report(name: str, r: Result, record_property: Callable[[str, object], None]) -> None:
    print(f"\n{name}: {r.states} distinct states, {r.transitions} transitions, "
          f"diameter {r.depth}, {r.seconds:.1f}s")  # fmt: skip
    record_property(f"{name}_states", r.states)
    record_property(f"{name}_seconds", round(r.seconds, 1))


def test_required_configuration_is_explored_to_exhaustion(
    record_property: Callable[[str, object], None],
) -> None:
    """Two owners, three receivers, three attempts and one failover, every state."""
    assert (REQUIRED.owners, REQUIRED.receivers, REQUIRED.max_attempts) >= (2, 3, 3)
    assert REQUIRED.failovers >= 1
    r = result("required")
    report("required", r, record_property)
    assert r.complete and r.violation is None, r.violation
    assert r.states > 100_000
    assert {"take_over", "fail", "commit", "cleanup"} <= r.actions


@pytest.mark.parametrize("name", [n for n in COVERAGE if n != "required"])
def test_coverage_configurations_hold_every_invariant(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    r = result(name)
    report(name, r, record_property)
    assert r.complete and r.violation is None, r.violation


ACROSS_TRANSITIONS = {Edge(ReceiverPhase.READY, Trigger.DENSE_REFIT, ReceiverPhase.REFITTED)}
"""Edges only runs of several transitions take (a receiver left out of a transition that
committed serves the version before): the membership model's search reaches them
(tests/model/test_membership_model.py)."""


def test_the_search_reaches_every_edge_of_the_table() -> None:
    reached: set[AnyEdge] = set(ACROSS_TRANSITIONS)
    for name in COVERAGE:
        reached |= result(name).edges
    missing = [
        f"{e.source.value} -{e.trigger.value}-> {e.dest.value}" for e in EDGES if e not in reached
    ]
    assert not missing, missing


def test_every_action_is_enabled_somewhere() -> None:
    enabled: set[str] = set()
    for name in COVERAGE:
        enabled |= result(name).actions
    assert enabled == set(ACTIONS)


@pytest.mark.deep
@pytest.mark.parametrize("name", list(HEAVY))
def test_heavy_configurations(name: str, record_property: Callable[[str, object], None]) -> None:
    r = explore(HEAVY[name])
    report(name, r, record_property)
    assert r.complete and r.violation is None, r.violation


# -- broken mirrors must yield a shortest counterexample --------------------------------------


def _map_states(
    action: Action, before: Callable[[State], State], after: Callable[[State, State], State]
) -> Action:
    """An action run on a doctored state whose results are doctored back."""

    def mutant(s: State, cfg: Config) -> Iterator[Step]:
        for step in action(before(s), cfg):
            yield Step(step.label, after(s, step.state), step.edges)

    return mutant


def _all_acked(s: State) -> State:
    return replace(s, attempts=tuple(a._replace(acks=a.required) for a in s.attempts))


def _real_acks(s: State, t: State) -> State:
    return replace(
        t,
        attempts=tuple(
            x._replace(acks=a.acks) for x, a in zip(t.attempts, s.attempts, strict=True)
        ),
    )


def _retry_in_mixed_mode(s: State, cfg: Config) -> Iterator[Step]:
    for step in streaming.prepare(s, cfg):
        attempts = (*step.state.attempts[:-1], step.state.attempts[-1]._replace(overwrite=False))
        yield Step(step.label, replace(step.state, attempts=attempts), step.edges)


def _ingest_without_dedupe(s: State, cfg: Config) -> Iterator[Step]:
    for p in sorted(s.inflight, key=lambda p: (p.attempt, p.range, p.receiver)):
        rx = s.receivers[p.receiver]
        forgetful = rx._replace(applied=frozenset(), staged=frozenset())
        receivers = (*s.receivers[: p.receiver], forgetful, *s.receivers[p.receiver + 1 :])
        for step in streaming.ingest(replace(s, receivers=receivers, inflight=frozenset({p})), cfg):
            got = step.state.receivers[p.receiver]
            # A receiver without deduplication takes the payload as new: applied again.
            kept = rx._replace(
                phase=got.phase, staged=rx.staged | got.staged, applied=rx.applied - {p.range}
            )
            new = (*s.receivers[: p.receiver], kept, *s.receivers[p.receiver + 1 :])
            yield Step(step.label, replace(s, receivers=new, inflight=s.inflight - {p}), step.edges)


def _reopen_keeping_kv(s: State, t: State) -> State:
    return replace(
        t,
        receivers=tuple(y._replace(kv=x.kv) for x, y in zip(s.receivers, t.receivers, strict=True)),
    )


def _cas_ignoring_epochs(s: State, cfg: Config) -> Iterator[Step]:
    for tau, a in enumerate(s.attempts, start=1):
        if a.cas is Cas.IN_FLIGHT:
            others = tuple(
                x._replace(cas=Cas.NONE) if i + 1 != tau else x for i, x in enumerate(s.attempts)
            )
            for step in commit.compare_and_set(replace(s, epoch=a.coord, attempts=others), cfg):
                attempts = tuple(
                    y if i + 1 == tau else x
                    for i, (x, y) in enumerate(zip(s.attempts, step.state.attempts, strict=True))
                )
                committed = step.state.record != s.record
                fixed = replace(
                    step.state,
                    epoch=s.epoch,
                    attempts=attempts,
                    commit_epoch=s.epoch if committed else s.commit_epoch,
                )
                yield Step(step.label, fixed, step.edges)


def _all_reported(s: State) -> State:
    everyone = frozenset(range(len(s.owners)))
    return replace(s, coords=tuple(c._replace(reported=everyone) for c in s.coords))


def _real_reports(s: State, t: State) -> State:
    return replace(
        t,
        coords=tuple(
            y._replace(reported=x.reported) for x, y in zip(s.coords, t.coords, strict=True)
        ),
    )


SMALL = Config(owners=1, receivers=2, max_attempts=2, failures=1, failovers=0, atomic_delivery=True)

BROKEN: dict[str, tuple[str, Action, Config, str]] = {
    "commit without every ACK": (
        "commit", _map_states(commit.commit, _all_acked, _real_acks), SMALL,
        "CommitRequiresAllAcks"),
    "XOR retry instead of overwrite": (
        "prepare", _retry_in_mixed_mode, SMALL, "XorAppliedOnce"),
    "no deduplication": (
        "ingest", _ingest_without_dedupe,
        Config(owners=1, receivers=1, max_attempts=1, failures=0, failovers=0, duplicates=1),
        "XorAppliedOnce"),
    "reopen without dropping the KV cache": (
        "reopen_gate", _map_states(recovery.reopen_gate, lambda s: s, _reopen_keeping_kv), SMALL,
        "GateClosedOnMixture"),
    "control plane accepts a replaced coordinator's commit": (
        "compare_and_set", _cas_ignoring_epochs,
        Config(owners=1, receivers=1, max_attempts=2, failures=0, failovers=1,
               atomic_delivery=True),
        "ReplacedNeverCommits"),
    "transition ends before every baseline update": (
        "cleanup", _map_states(recovery.cleanup, _all_reported, _real_reports),
        Config(owners=2, receivers=1, max_attempts=1, failures=0, failovers=0,
               atomic_delivery=True),
        "BaselineMatchesCommit"),
}  # fmt: skip


@pytest.mark.parametrize("bug", list(BROKEN))
def test_broken_mirror_yields_a_shortest_counterexample(bug: str) -> None:
    name, mutant, cfg, invariant = BROKEN[bug]
    actions = {**ACTIONS, name: mutant}
    r = explore(cfg, actions=actions)
    assert r.violation is not None, f"{bug}: no counterexample in {r.states} states"
    assert r.violation.invariant == invariant, str(r.violation)
    trace = r.violation.trace
    print(f"\n{bug}:\n{r.violation}")
    # Shortest: nothing shorter violates any invariant (breadth-first order), and the trace
    # replays step by step from the initial state.
    assert explore(cfg, actions=actions, max_depth=len(trace) - 1).violation is None
    assert trace and all(step.label for step in trace)
    assert any(step.label.startswith(name) for step in trace)


def test_the_correct_mirror_passes_the_broken_mirror_configurations() -> None:
    for _, _, cfg, _ in BROKEN.values():
        assert explore(cfg).violation is None


def test_commit_reply_states_are_reachable() -> None:
    """Guard against a vacuous model: unknown outcomes and lost replies do occur."""
    r = result("replaced-keeps-running")
    assert {"commit_unknown", "read_commit", "lose_commit_reply", "expire_deadline"} <= r.actions
