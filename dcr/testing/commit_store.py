"""A conformance suite for commit stores: :class:`CommitStoreTests`, a pytest test-class base.

Its check is a hypothesis state machine, :class:`CommitStoreMachine`: it drives a store
created by ``factory(clock)`` through claims, registrations, compare-and-sets (with deadlines
in the past or future), obsolete marks and reads, and checks every answer against a small
reference model of the semantics in :mod:`dcr.adapters.commit.base`.  A store's test module
subclasses the suite -- ``class TestMyStore(CommitStoreTests)`` -- and gives it
:meth:`CommitStoreTests.make_store`; dcr's own stores run it in
``tests/adapters/test_commit_store*.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dcr.adapters.commit.base import INITIAL_RECORD, CommitStore
from dcr.errors import CommitConflict
from dcr.protocol.types import CommitOutcome, CommitRecord

__all__ = ["CommitStoreMachine", "CommitStoreTests", "ManualClock"]


@dataclass(slots=True)
class ManualClock:
    """A clock the test moves by hand."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class _Model:
    record: CommitRecord = INITIAL_RECORD
    epoch: int = 0
    attempt: int | None = None
    obsolete: set[int] = field(default_factory=set)
    info: str = ""
    history: list[CommitRecord] = field(default_factory=lambda: [INITIAL_RECORD])


class CommitStoreMachine(RuleBasedStateMachine):
    """Store answers must equal the reference model's; at most one commit per version."""

    factory: Callable[[ManualClock], CommitStore]

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        self.store = self.factory(self.clock)
        self.model = _Model()
        self.next_attempt = 1

    @classmethod
    def for_store(cls, factory: Callable[[ManualClock], CommitStore]) -> type[Any]:
        return type(f"{cls.__name__}For", (cls,), {"factory": staticmethod(factory)})

    def call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        return self.portal.call(lambda: fn(**kwargs))

    def teardown(self) -> None:
        self.call(self.store.close)
        self.portal_cm.__exit__(None, None, None)

    @rule()
    def claim(self) -> None:
        epoch = self.call(self.store.claim)
        self.model.epoch += 1
        assert epoch == self.model.epoch

    @rule(stale=st.booleans(), stale_base=st.booleans())
    def register(self, stale: bool, stale_base: bool) -> None:
        epoch = self.model.epoch - 1 if stale else self.model.epoch
        attempt = self.next_attempt
        self.next_attempt += 1
        base = self.model.record if not stale_base else self.model.history[0]
        try:
            self.call(
                self.store.register, epoch=epoch, attempt=attempt, base=base, info=f"i{attempt}"
            )
        except CommitConflict:
            assert epoch != self.model.epoch or base != self.model.record
            return
        assert epoch == self.model.epoch and base == self.model.record
        self.model.attempt = attempt
        self.model.info = f"i{attempt}"

    @precondition(lambda self: self.next_attempt > 1)
    @rule(
        which=st.sampled_from(["active", "old", "future"]),
        stale_epoch=st.booleans(),
        late=st.booleans(),
        expect_current=st.booleans(),
    )
    def compare_and_set(
        self, which: str, stale_epoch: bool, late: bool, expect_current: bool
    ) -> None:
        m = self.model
        attempt = {
            "active": m.attempt if m.attempt is not None else 1,
            "old": max(1, self.next_attempt - 3),
            "future": self.next_attempt + 5,
        }[which]
        epoch = m.epoch - 1 if stale_epoch else m.epoch
        expected = m.record if expect_current else m.history[0]
        new = CommitRecord(version=expected.version + 1, candidate=f"g{attempt}")
        deadline = self.clock.now + (-1.0 if late else 30.0)
        got = self.call(
            self.store.compare_and_set,
            epoch=epoch,
            attempt=attempt,
            expected=expected,
            new=new,
            deadline=deadline,
        )
        if epoch != m.epoch:
            want = CommitOutcome.CONFLICT
        elif m.record == new:
            want = CommitOutcome.SUCCEEDED
        elif m.record != expected:
            want = CommitOutcome.CONFLICT
        elif attempt in m.obsolete or attempt != m.attempt or late:
            want = CommitOutcome.FAILED
        else:
            want = CommitOutcome.SUCCEEDED
            m.record = new
            m.history.append(new)
        assert got == want, (got, want)

    @precondition(lambda self: self.next_attempt > 1)
    @rule(back=st.integers(1, 3))
    def mark_obsolete(self, back: int) -> None:
        attempt = max(1, self.next_attempt - back)
        self.call(self.store.mark_obsolete, attempt=attempt)
        self.model.obsolete.add(attempt)

    @rule(dt=st.floats(0.0, 60.0))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @precondition(lambda self: self.next_attempt > 1)
    @rule()
    def read_commit_after_deadline(self) -> None:
        record = self.call(
            self.store.read_commit, attempt=self.next_attempt - 1, deadline=self.clock.now - 1
        )
        assert record == self.model.record

    @invariant()
    def state_matches(self) -> None:
        s = self.call(self.store.read)
        m = self.model
        assert s.record == m.record
        assert s.epoch == m.epoch
        assert s.attempt == m.attempt
        assert s.info == m.info
        assert set(s.obsolete) == m.obsolete
        versions = [r.version for r in m.history]
        assert versions == sorted(set(versions))  # one commit per version, never backwards


class CommitStoreTests:
    """The commit-store conformance suite; subclass it as ``Test<YourStore>`` and give it
    :meth:`make_store`.  :attr:`max_examples` and :attr:`steps` size the run (a store on a
    remote server lowers them)."""

    max_examples: ClassVar[int] = 30
    """Runs of the state machine, each from a fresh store."""
    steps: ClassVar[int] = 25
    """Rules per run."""

    def make_store(self, clock: ManualClock) -> CommitStore:
        """A fresh, empty store whose deadlines read ``clock`` (each call a new record)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_store(clock)")

    def test_answers_match_the_reference_model(self) -> None:
        """Every answer of the store equals the reference model's; at most one commit per
        version, never backwards."""
        run_state_machine_as_test(
            CommitStoreMachine.for_store(self.make_store),
            settings=settings(
                max_examples=self.max_examples,
                stateful_step_count=self.steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
