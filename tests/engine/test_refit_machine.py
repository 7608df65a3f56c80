"""The whole system under a hypothesis state machine: real cores, anyio engine, in-memory
adapters and real tensors; bit-exact after every commit whatever fault struck."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from dcr.testing.refit_machine import FAULT_RULES, RefitMachine

STEPS: list[int] = []
SEEN: dict[str, int] = {}


class CountingMachine(RefitMachine):
    def teardown(self) -> None:
        STEPS.append(self.steps)
        for k, v in self.seen.items():
            SEEN[k] = SEEN.get(k, 0) + v
        super().teardown()


def run(examples: int, steps: int) -> None:
    STEPS.clear()
    SEEN.clear()
    run_state_machine_as_test(
        CountingMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"\nrefit machine: {sum(STEPS)} transitions in {len(STEPS)} runs; rules {SEEN}")


def test_refits_under_faults_stay_bit_exact():
    run(examples=8, steps=6)
    assert sum(STEPS) >= 8


def every_fault_once() -> None:
    """One machine takes every fault rule in turn, invariants checked after each refit (the
    random runs need not draw every rule)."""
    machine = CountingMachine()
    try:
        for i, fault in enumerate(sorted(FAULT_RULES)):
            machine.faulty_refit(fault=fault, rate=0.01, seed=i + 1, special=i % 2 == 0)
            machine.receivers_hold_exactly_the_committed_version()
            machine.baseline_is_the_committed_version()
            machine.one_commit_per_refit()
    finally:
        machine.teardown()


def test_every_fault_rule_once_stays_bit_exact():
    SEEN.clear()
    every_fault_once()
    assert dict(SEEN) == dict.fromkeys(FAULT_RULES, 1)


@pytest.mark.deep
def test_refits_under_faults_stay_bit_exact_long():
    run(examples=20, steps=10)
    assert sum(STEPS) >= 100 and len(SEEN) >= 6
