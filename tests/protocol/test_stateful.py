"""The real cores under random faults keep the model's invariants (and finish once faults stop)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from dcr.protocol.attempt import Attempt
from dcr.testing.protocol_machine import ProtocolMachine


def _run(examples: int, steps: int) -> int:
    before = ProtocolMachine.steps
    run_state_machine_as_test(
        ProtocolMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    return ProtocolMachine.steps - before


def test_real_cores_keep_the_invariants_under_faults(
    record_property: Callable[[str, object], None],
) -> None:
    steps = _run(examples=300, steps=80)
    print(f"\nprotocol state machine: {steps} steps")
    record_property("hypothesis_steps", steps)
    assert steps > 3_000  # guards against a vacuous run


@pytest.mark.deep
def test_real_cores_keep_the_invariants_under_faults_long(
    record_property: Callable[[str, object], None],
) -> None:
    steps = _run(examples=1_500, steps=100)
    print(f"\nprotocol state machine (heavy): {steps} steps")
    record_property("hypothesis_steps_heavy", steps)


def test_the_machine_catches_a_coordinator_that_commits_without_every_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stateful checks can fail: break the commit guard and expect a counterexample."""
    monkeypatch.setattr(Attempt, "_all_acked", lambda self: None)
    with pytest.raises(AssertionError, match="CommitRequiresAllAcks"):
        run_state_machine_as_test(
            ProtocolMachine,
            settings=settings(
                max_examples=300,
                stateful_step_count=60,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            ),
        )
