"""Departures in runs of several transitions: the membership model (models/membership.tla,
``dcr.testing.spec.membership``) with receivers that depart interleaved anywhere.

A departure (``Departed``, :mod:`dcr.protocol.membership`) is the active coordinator's core
forgetting a receiver it had heard from (or one of the attempt a takeover resumes): it is no
longer a member, a joiner or engaged, its dense job is released, and a running transition
takes it out of its members and retires it from the attempt in progress (which stops, cleans
up -- the departed receiver too, since the calls still address it -- and is retried without
it in overwrite mode).  The receiver's process is left as it is: it may come back (it reports
again and rejoins as one seen for the first time), or never (``gone for good``).

The model's own state has no place for the set of departed receivers, so this module extends
it (:class:`DepartureState`) and wraps the two rules that read it: a report of a departed
receiver ends its departure, and a departed receiver is not a joiner a transition waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest

from dcr.testing.spec.checker import Model, Result, explore
from dcr.testing.spec.configs import MEMBERSHIP_COVERAGE
from dcr.testing.spec.membership import actions as A
from dcr.testing.spec.membership import rules
from dcr.testing.spec.membership.invariants import INVARIANTS
from dcr.testing.spec.membership.rules import Draft, RunStep, stop_bound, unfinished
from dcr.testing.spec.membership.state import RunConfig, State
from dcr.testing.spec.membership.symmetry import canonical, canonical_order, normalize_seen


@dataclass(frozen=True, slots=True)
class DepartureState(State):
    """A state of the membership model and the receivers that departed and have not reported
    to the active coordinator since (``MembershipCore.gone()``)."""

    gone: frozenset[int] = frozenset()
    departures: int = 0
    """Departures left to explore (the bound of the search, as the model's budgets)."""

    def __hash__(self) -> int:
        return hash((self._hash, self.gone, self.departures))


DEPARTURES_EXPLORED = 1
"""Departures in each explored run (any receiver, at any point, possibly returning)."""


def initial(cfg: RunConfig) -> DepartureState:
    s = A.initial_state(cfg)
    fields = {f: getattr(s, f) for f in State.__dataclass_fields__ if f != "_hash"}
    return DepartureState(**fields, departures=DEPARTURES_EXPLORED)


def _gone(s: State) -> frozenset[int]:
    return s.gone if isinstance(s, DepartureState) else frozenset()


# -- the departure and the rules that read it ------------------------------------------------


def departable(s: State) -> list[int]:
    """``MembershipCore.departable()``: receivers that reported, and those of an attempt the
    running transition takes over."""
    gone = _gone(s)
    names = {r for r, st in enumerate(s.core.receivers) if st is not None}
    if s.run is not None and s.run.take_over:
        names |= set(s.run.members) - gone
    return sorted(names)


def depart(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A receiver departs: the core forgets its status and job, and the running transition
    goes on without it (retired from the attempt in progress, which fails and is retried)."""
    left = s.departures if isinstance(s, DepartureState) else 0
    if not left:
        return
    for r in departable(s):
        d = Draft(s)
        views = list(s.core.receivers)
        views[r] = None
        d.edit_core(
            receivers=tuple(views),
            engaged=s.core.engaged - {r},
            unverified=s.core.unverified | {r},
        )
        d.job(r, None)
        run = s.run
        if run is not None:
            d.edit_core(restarted=d.core.restarted | {r})
            if not run.committed:
                new = run._replace(members=run.members - {r})
                if run.attempt and any(x == r for x, _ in run.bound):
                    # Retired from the attempt in progress (admitted: the retry overwrites).
                    stop_bound(d, run)
                    new = new._replace(
                        attempt=0, bound=frozenset(), applied=frozenset(), overwrite=True
                    )
                d.set(run=new)
        d.set(gone=_gone(s) | {r}, departures=left - 1)
        yield d.step(f"depart(r{r})")


def report(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A departed receiver that reports again rejoins as one seen for the first time."""
    for step in rules.report(s, cfg):
        back = {r for r in _gone(s) if step.state.core.receivers[r] is not None}
        yield RunStep(step.label, step.state.evolve(gone=_gone(s) - back))


def report_never_back(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """Departed receivers are gone for good: they never report again."""
    for step in report(s, cfg):
        if _gone(step.state) == _gone(s):
            yield step


def run_transition(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A transition does not wait for a departed receiver (only for joiners that are not)."""
    gone = _gone(s)
    joiners = {r for r, st in enumerate(s.core.receivers) if st is None or st.record != s.record}
    if joiners and joiners <= gone and not unfinished(s):
        # Only departed receivers would make it wait: it starts at once (no join-wait spent).
        waits = s.budgets._replace(join_waits=s.budgets.join_waits + 1)
        for step in rules.run_transition(s.evolve(budgets=waits), cfg):
            yield _without_the_departed(
                s, RunStep(step.label, step.state.evolve(budgets=s.budgets))
            )
        return
    for step in rules.run_transition(s, cfg):
        yield _without_the_departed(s, step)


def _without_the_departed(s: State, step: RunStep) -> RunStep:
    """A transition that takes over an attempt binding departed receivers goes on without
    them (``Depart``), and no stop of it waits for them."""
    run, gone = step.state.run, _gone(s)
    if run is None or not run.take_over or not run.members & gone:
        return step
    core = step.state.core._replace(restarted=step.state.core.restarted | (run.members & gone))
    return RunStep(
        step.label, step.state.evolve(core=core, run=run._replace(members=run.members - gone))
    )


def receive_dense(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A dense job never writes under an open gate: a receiver that still serves (cleaned up
    after an attempt that failed before admission, then left out of the next ones -- which a
    departure makes possible) closes its gate when the job starts (``ReceiverCore``)."""
    for step in A.receive_dense(s, cfg):
        receivers = tuple(
            rx._replace(gate=False) if rx.dense is not None and rx.dense != before.dense else rx
            for rx, before in zip(step.state.receivers, s.receivers, strict=True)
        )
        yield RunStep(step.label, step.state.evolve(receivers=receivers))


def take_over(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """The standby's fresh core has heard of no departure."""
    for step in A.take_over(s, cfg):
        yield RunStep(step.label, step.state.evolve(gone=frozenset()))


def canonical_departures(s: State) -> State:
    """:func:`canonical`, with the departed receivers renamed alike."""
    gone = _gone(s)
    if not gone:
        return canonical(s)
    new = {old: i for i, old in enumerate(canonical_order(normalize_seen(s)))}
    return canonical(s).evolve(gone=frozenset(new[r] for r in gone))


# -- invariants --------------------------------------------------------------------------------


def departed_not_required(s: State) -> str | None:
    """A departed receiver is neither a member, a joiner nor engaged, and has no dense job."""
    for r in sorted(_gone(s)):
        if s.core.receivers[r] is not None or s.core.jobs[r] is not None:
            return f"receiver {r} departed but the core keeps its status or job"
        if r in s.core.engaged:
            return f"receiver {r} departed but settling waits for it"
        if s.run is not None and not s.run.committed and r in s.run.members:
            return f"receiver {r} departed but the running transition still requires it"
    return None


DEPARTURE_INVARIANTS = {**INVARIANTS, "DepartedNotRequired": departed_not_required}

ACTIONS = {
    **A.ACTIONS,
    "report": report,
    "run_transition": run_transition,
    "take_over": take_over,
    "receive_dense": receive_dense,
    "depart": depart,
}
DEPARTURES = Model(
    initial=initial,
    actions=ACTIONS,
    invariants=DEPARTURE_INVARIANTS,
    canonical=canonical_departures,
)
"""The membership model with departures."""

GONE_FOR_GOOD = Model(
    initial=initial,
    actions={**ACTIONS, "report": report_never_back},
    invariants=DEPARTURE_INVARIANTS,
    canonical=canonical_departures,
)
"""Departed receivers never come back."""

CONFIGS: dict[str, RunConfig] = {
    "foreign-checkpoint-1": replace(MEMBERSHIP_COVERAGE["foreign-checkpoint"], transitions=1),
    "settling-1": replace(MEMBERSHIP_COVERAGE["settling"], transitions=1),
}
"""Membership configurations explored with one departure (seconds each)."""

HEAVY: dict[str, RunConfig] = {
    "foreign-checkpoint": MEMBERSHIP_COVERAGE["foreign-checkpoint"],
    "checkpoint-restart": MEMBERSHIP_COVERAGE["checkpoint-restart"],
    "two-takeovers": MEMBERSHIP_COVERAGE["two-takeovers"],
}
"""Larger ones, explored by ``make test-deep``: 129K, 181K and 467K distinct states (20 s to
five minutes each on a 2-core machine)."""

EXHAUSTIVE: dict[str, RunConfig] = {
    "dense-faults-1": replace(MEMBERSHIP_COVERAGE["dense-faults"], transitions=1),
    "join-wait-1": replace(MEMBERSHIP_COVERAGE["join-wait"], transitions=1),
    "settling": MEMBERSHIP_COVERAGE["settling"],
}
"""Explored with departures by ``make test-deep`` (135K, 331K and 260K distinct states, every
invariant held), not on every test run; ``settling-1`` above covers the settling path on
every run."""

_results: dict[tuple[str, str], Result] = {}


def result(name: str, model: str = "departures") -> Result:
    key = (name, model)
    if key not in _results:
        m = DEPARTURES if model == "departures" else GONE_FOR_GOOD
        _results[key] = explore({**CONFIGS, **HEAVY, **EXHAUSTIVE}[name], model=m)
    return _results[key]


def _check(name: str, record_property: Callable[[str, object], None]) -> None:
    r = result(name)
    print(f"\ndepartures {name}: {r.states} distinct states, {r.seconds:.1f}s")
    record_property(f"departures_{name}_states", r.states)
    assert r.complete and r.violation is None, r.violation
    assert "depart" in r.actions


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_invariant_holds_with_departures_interleaved(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    _check(name, record_property)


LONG_S = {"checkpoint-restart": 3600, "settling": 3600}
"""The deep cases that run past pytest's 600 s: since a ready receiver takes a dense job of a
newer record, checkpoint-restart has 2.37M distinct states (181K before; 934 s on a 2-core
machine beside a test run)."""


@pytest.mark.deep
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.timeout(LONG_S[n])) if n in LONG_S else n
     for n in [*HEAVY, *EXHAUSTIVE]],
)  # fmt: skip
def test_heavy_departure_configurations(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    _check(name, record_property)


def test_departures_and_returns_are_explored() -> None:
    """Departures happen before, during and after transitions, of members bound to an
    attempt, and departed receivers come back (and are restored)."""
    labels: set[str] = set()
    for name in CONFIGS:
        r = result(name)
        assert {"depart", "report", "restore", "reopen_gate", "commit"} <= r.actions
        labels |= r.actions
    assert labels >= set(A.ACTIONS) - {"restart_owner", "take_over", "lose_dense"}


# -- what the departure changes ----------------------------------------------------------------


def _committed_without_the_departed(cfg: RunConfig) -> Callable[[State], str | None]:
    """Reached: the last version is committed while a receiver that departed for good before
    the last transition started (it took part in neither of the last two commits) is gone."""

    def check(s: State) -> str | None:
        last = (cfg.transitions, cfg.transitions - 1)
        left = [r for r in sorted(_gone(s)) if s.receivers[r].storage not in last]
        if s.record == cfg.transitions and left:
            return f"version {s.record} committed while receivers {left} are gone"
        return None

    return check


REACH_CONFIG = replace(MEMBERSHIP_COVERAGE["settling"], join_waits=0, settle_timeouts=0, retries=0)
"""Two transitions, no join wait to spend: a transition that waits for a joiner waits."""


def test_a_fleet_whose_receiver_departed_for_good_still_commits_every_version() -> None:
    """The search reaches a state where every version is committed although a receiver left
    for good before the last commit."""
    cfg = REACH_CONFIG
    model = replace(GONE_FOR_GOOD, invariants={"Reached": _committed_without_the_departed(cfg)})
    r = explore(cfg, model=model)
    assert r.violation is not None, f"never commits every version without it ({r.states})"
    assert any(step.label.startswith("depart") for step in r.violation.trace)
    print(f"\n{r.violation}")


def test_a_departed_receiver_counted_as_a_joiner_holds_the_fleet_back() -> None:
    """With the join wait's rule unchanged (a departed receiver, whose status the core forgot,
    counts as a joiner), the next transition waits for it and the last version is never
    committed without it."""
    cfg = REACH_CONFIG
    model = replace(
        GONE_FOR_GOOD,
        actions={**GONE_FOR_GOOD.actions, "run_transition": rules.run_transition},
        invariants={"Reached": _committed_without_the_departed(cfg)},
    )
    r = explore(cfg, model=model)
    assert r.complete and r.violation is None, r.violation


def _report_trusting_the_departed(s: State, cfg: RunConfig) -> Iterator[RunStep]:
    """A core that takes a returning receiver's claim on trust (it stays verified)."""
    for step in report(s, cfg):
        back = _gone(s) - _gone(step.state)
        core = step.state.core._replace(unverified=step.state.core.unverified - back)
        yield RunStep(step.label, replace(step.state, core=core))


@pytest.mark.heavy
def test_a_core_that_trusts_a_returning_receiver_breaks_members_hold_base() -> None:
    """A receiver departs and a process starts in its place from a checkpoint that is not what
    it claims: taken on trust when it reports, it takes part in a mixed-mode attempt.  With
    the rule (it rejoins unverified) the same search finds nothing
    (``test_heavy_departure_configurations[foreign-checkpoint]``, a ``deep`` case)."""
    cfg = HEAVY["foreign-checkpoint"]
    model = replace(DEPARTURES, actions={**ACTIONS, "report": _report_trusting_the_departed})
    r = explore(cfg, model=model)
    assert r.violation is not None and r.violation.invariant == "MembersHoldBase", r.violation
    assert any(step.label.startswith("depart") for step in r.violation.trace)
    print(f"\n{r.violation}")
