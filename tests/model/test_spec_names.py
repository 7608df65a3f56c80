"""models/refit.tla and models/membership.tla and their Python mirrors name the same actions,
triggers and invariants."""

from __future__ import annotations

import re
from pathlib import Path

from dcr.protocol.lifecycle import Trigger
from dcr.testing.spec.actions import ACTIONS, ENVIRONMENT
from dcr.testing.spec.invariants import INVARIANTS
from dcr.testing.spec.membership import actions as membership
from dcr.testing.spec.membership.invariants import INVARIANTS as MEMBERSHIP_INVARIANTS

MODELS = Path(__file__).resolve().parents[2] / "models"
TLA = (MODELS / "refit.tla").read_text()
MEMBERSHIP_TLA = (MODELS / "membership.tla").read_text()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _definition(name: str, tla: str = TLA) -> str:
    """The text of the TLA+ definition ``name == ...`` (up to the next top-level definition)."""
    match = re.search(rf"^{name} ==\n?(.*?)(?=^\S|\Z)", tla, re.S | re.M)
    assert match, f"{name} is not defined"
    return match.group(1)


def tla_actions(tla: str = TLA) -> set[str]:
    """Actions are the operators that the next-state relation ``Next`` calls."""
    called = re.findall(r"\b([A-Z][A-Za-z]+)\b(?:\(|\s*$|\s*\\/)", _definition("Next", tla), re.M)
    return set(called) - {"E"}  # \E


def test_tla_actions_are_the_python_mirror_actions() -> None:
    assert {_snake(a) for a in tla_actions()} == set(ACTIONS)
    for action in tla_actions():
        assert re.search(rf"^{action}(\(.*\))? ==", TLA, re.M), f"{action} has no definition"


def test_every_trigger_is_an_action_and_the_rest_are_environment() -> None:
    triggers = {t.value for t in Trigger}
    assert triggers <= set(ACTIONS)
    assert set(ACTIONS) - triggers == ENVIRONMENT


def test_invariants_are_defined_in_both() -> None:
    for name in INVARIANTS:
        assert re.search(rf"^{name} ==", TLA, re.M), f"invariant {name} missing in refit.tla"
    cfg = (Path(__file__).resolve().parents[2] / "models" / "refit.cfg").read_text()
    assert set(re.findall(r"^INVARIANT\s+(\w+)", cfg, re.M)) == set(INVARIANTS)


def test_membership_actions_and_invariants_are_named_alike() -> None:
    actions = tla_actions(MEMBERSHIP_TLA)
    assert {_snake(a) for a in actions} == set(membership.ACTIONS)
    for action in actions:
        assert re.search(rf"^{action}(\(.*\))? ==", MEMBERSHIP_TLA, re.M), action
    assert set(membership.ACTIONS) >= membership.ENVIRONMENT
    for name in MEMBERSHIP_INVARIANTS:
        assert re.search(rf"^{name} ==", MEMBERSHIP_TLA, re.M), f"{name} missing"
    cfg = (MODELS / "membership.cfg").read_text()
    assert set(re.findall(r"^INVARIANT\s+(\w+)", cfg, re.M)) == set(MEMBERSHIP_INVARIANTS)
