"""The symmetry reductions name each state by one canonical form, whatever the receivers'
order, and their memo (``dcr.testing.spec.memo``) never changes a form: for every state a
search meets, the form computed while the memo is warm from the states before it equals the
one computed from nothing, and the state with its receivers in reverse order has the same
form."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from dcr.testing.spec import memo
from dcr.testing.spec.checker import TRANSITION, Model, renumber
from dcr.testing.spec.configs import MEMBERSHIP_REQUIRED, REQUIRED
from dcr.testing.spec.membership import MEMBERSHIP
from dcr.testing.spec.membership.symmetry import renumber as renumber_run

STATES = 3000


def _states(model: Model, cfg: Any) -> list[Any]:
    """The first :data:`STATES` successors a breadth-first search builds, as built (not
    canonical)."""
    seen = {model.canonical(model.initial(cfg))}
    queue = deque(seen)
    found: list[Any] = []
    while queue and len(found) < STATES:
        s = queue.popleft()
        for action in model.actions.values():
            for step in action(s, cfg):
                found.append(step.state)
                t = model.canonical(step.state)
                if t not in seen:
                    seen.add(t)
                    queue.append(t)
    return found


CASES: dict[str, tuple[Model, Any, Callable[[Any, Any], Any]]] = {
    "transition": (TRANSITION, REQUIRED, lambda s, order: renumber(s, tuple(order))),
    "membership": (MEMBERSHIP, MEMBERSHIP_REQUIRED, renumber_run),
}


@pytest.mark.parametrize("name", list(CASES))
def test_canonical_forms_hold_with_a_warm_memo_and_any_receiver_order(name: str) -> None:
    model, cfg, rename = CASES[name]
    states = _states(model, cfg)
    assert len(states) >= STATES
    memo.clear()
    warm = [model.canonical(s) for s in states]
    reordered = sum(w is not s for w, s in zip(warm, states, strict=True))
    assert reordered > STATES // 10  # the renumbering ran, not only the identity
    for s, w in zip(states, warm, strict=True):
        reverse = list(range(len(s.receivers)))[::-1]
        assert model.canonical(rename(s, reverse)) == w
        memo.clear()
        assert model.canonical(s) == w
