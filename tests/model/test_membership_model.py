"""Exhaustive checking of runs of several transitions (models/membership.tla): joins,
restarts, dense refits and takeovers between transitions."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.types import EpochIds
from dcr.testing.spec.checker import Result, explore
from dcr.testing.spec.configs import MEMBERSHIP_COVERAGE, MEMBERSHIP_REQUIRED, MEMBERSHIP_TODAY
from dcr.testing.spec.membership import MEMBERSHIP, RunConfig, rules
from dcr.testing.spec.membership import actions as A
from dcr.testing.spec.membership.invariants import INVARIANTS, STRONG_JOB_EPOCHS
from dcr.testing.spec.membership.rules import RunStep
from dcr.testing.spec.membership.state import State, attempt_id, job_id

_results: dict[str, Result] = {}


def result(name: str) -> Result:
    """Each coverage configuration is explored once per session."""
    if name not in _results:
        _results[name] = explore(MEMBERSHIP_COVERAGE[name], model=MEMBERSHIP)
    return _results[name]


def report(name: str, r: Result, record_property: Callable[[str, object], None]) -> None:
    print(f"\nmembership {name}: {r.states} distinct states, {r.transitions} transitions, "
          f"diameter {r.depth}, {r.seconds:.1f}s")  # fmt: skip
    record_property(f"membership_{name}_states", r.states)
    record_property(f"membership_{name}_seconds", round(r.seconds, 1))


@pytest.mark.timeout(1800)  # 85 s alone on a 2-core machine, 600 s loaded three times over
def test_a_restart_and_a_takeover_over_two_transitions_are_explored_to_exhaustion(
    record_property: Callable[[str, object], None],
) -> None:
    cfg = MEMBERSHIP_REQUIRED
    assert (cfg.owners, cfg.receivers, cfg.transitions) == (1, 2, 2)
    assert (cfg.restarts, cfg.takeovers) == (1, 1)
    r = result("restart-and-takeover")
    report("restart-and-takeover", r, record_property)
    assert r.complete and r.violation is None, r.violation
    assert r.states > 100_000
    assert {"take_over", "restart_receiver", "restore", "reopen_gate", "fail_attempt"} <= r.actions


@pytest.mark.parametrize("name", [n for n in MEMBERSHIP_COVERAGE if n != "restart-and-takeover"])
def test_membership_configurations_hold_every_invariant(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    r = result(name)
    report(name, r, record_property)
    assert r.complete and r.violation is None, r.violation


def test_a_ready_receiver_left_behind_takes_a_dense_job() -> None:
    """A receiver that serves the version before the record (left out of the transition that
    committed it) accepts the dense job that restores it, and every invariant still holds."""
    behind: list[str] = []

    def receive_dense(s: State, cfg: RunConfig) -> Iterator[RunStep]:
        for step in A.receive_dense(s, cfg):
            for call in s.to_receivers - step.state.to_receivers:
                rx, after = s.receivers[call.receiver], step.state.receivers[call.receiver]
                if rx.phase is ReceiverPhase.READY and rx.held != call.record and after.dense:
                    assert not after.gate, "a dense job started under an open gate"
                    behind.append(step.label)
            yield step

    actions = {**MEMBERSHIP.actions, "receive_dense": receive_dense}
    # The smallest configuration that leaves a receiver behind (827 states; join-wait and
    # checkpoint-restart do too, with 62K and 28K).
    r = explore(MEMBERSHIP_COVERAGE["foreign-checkpoint"], model=MEMBERSHIP, actions=actions)
    assert r.complete and r.violation is None, r.violation
    assert behind


def test_every_membership_action_is_enabled_somewhere() -> None:
    """The three smallest configurations that together take every action (the larger ones,
    explored by the tests above, take fewer kinds of faults)."""
    enabled: set[str] = set()
    for name in ("dense-faults", "owner-restart", "two-takeovers"):
        enabled |= result(name).actions
    assert enabled == set(A.ACTIONS)


@pytest.mark.parametrize("name", list(MEMBERSHIP_TODAY))
def test_todays_rules_violate_an_invariant(name: str) -> None:
    """Each of today's rules that the proposed fixes change yields a counterexample (see
    tests/protocol/test_membership_findings.py for the same problems on the real cores)."""
    cfg, invariant = MEMBERSHIP_TODAY[name]
    r = explore(cfg, model=MEMBERSHIP)
    assert r.violation is not None, f"{name}: no counterexample in {r.states} states"
    assert r.violation.invariant == invariant, str(r.violation)
    print(f"\n{name}:\n{r.violation}")


def test_the_strong_form_of_job_epochs_does_not_hold() -> None:
    """A job issued under an epoch is acted on after a newer epoch became active: its own
    coordinator's run claims a new epoch while the jobs go on under the old one."""
    cfg = replace(MEMBERSHIP_COVERAGE["join-wait"])
    r = explore(cfg, model=MEMBERSHIP, invariants={**INVARIANTS, **STRONG_JOB_EPOCHS})
    assert r.violation is not None and r.violation.invariant == "NoJobOfAnOlderEpoch"


# -- broken mirrors must yield a shortest counterexample --------------------------------------


def _report_without_unverifying(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A core that does not fingerprint restarted receivers again."""
    for step in rules.report(s, cfg):
        core = step.state.core._replace(unverified=s.core.unverified & step.state.core.unverified)
        yield RunStep(step.label, replace(step.state, core=core))


def _take_over_keeping_jobs(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A successor that adopts the replaced coordinator's dense jobs."""
    for step in A.take_over(s, cfg):
        yield RunStep(step.label, replace(step.state, core=step.state.core._replace(
            jobs=s.core.jobs)))  # fmt: skip


SMALL = MEMBERSHIP_COVERAGE["foreign-checkpoint"]
BROKEN: dict[str, tuple[str, Callable[[State, RunConfig], Iterator[RunStep]], RunConfig, str]] = {
    "no fingerprint on join": (
        "prepare", A.prepare, replace(SMALL, fingerprint_on_join=False), "MembersHoldBase"),
    "restarted receivers not fingerprinted": (
        "report", _report_without_unverifying, SMALL, "MembersHoldBase"),
    "a successor acts on replaced jobs": (
        "take_over", _take_over_keeping_jobs,
        replace(SMALL, foreign=0, transitions=1, restarts=1, join_waits=1, takeovers=1),
        "JobsOfTheActiveCoordinator"),
}  # fmt: skip


@pytest.mark.parametrize("bug", list(BROKEN))
def test_broken_membership_mirror_yields_a_shortest_counterexample(bug: str) -> None:
    name, mutant, cfg, invariant = BROKEN[bug]
    actions = {**A.ACTIONS, name: mutant}
    r = explore(cfg, model=MEMBERSHIP, actions=actions)
    assert r.violation is not None, f"{bug}: no counterexample in {r.states} states"
    assert r.violation.invariant == invariant, str(r.violation)
    trace = r.violation.trace
    print(f"\n{bug}:\n{r.violation}")
    assert (
        explore(cfg, model=MEMBERSHIP, actions=actions, max_depth=len(trace) - 1).violation is None
    )
    assert any(step.label.startswith(name) for step in trace)


def test_the_models_ids_are_the_protocols() -> None:
    for epoch in (1, 2, 7):
        ids = EpochIds(epoch)
        assert [ids.dense_job() for _ in range(3)] == [job_id(epoch, n) for n in (1, 2, 3)]
        attempts = ids.attempts()
        assert [attempts.fresh()[0] for _ in range(3)] == [attempt_id(epoch, n) for n in range(3)]
