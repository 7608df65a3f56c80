"""A conformance suite for commit stores: :class:`CommitStoreTests`, a pytest test-class base.

Its check is a hypothesis state machine, :class:`CommitStoreMachine`: it drives a store
created by ``factory(clock)`` through claims, registrations, compare-and-sets (with deadlines
in the past or future), obsolete marks and reads, and checks every answer against a small
reference model of the semantics in :mod:`dcr.adapters.commit.base`.  A store's test module
subclasses the suite -- ``class TestMyStore(CommitStoreTests)`` -- and gives it
:meth:`CommitStoreTests.make_store`; dcr's own stores run it in
``tests/adapters/test_commit_store*.py``.

A durable store (one whose record outlives the process) subclasses
:class:`DurableCommitStoreTests` instead, which adds the rule that a record never rewinds: once
written, a record lost behind the store's back (:meth:`DurableCommitStoreTests.lose_record`)
is a ``CommitStoreError`` with ``check="missing"`` on reads and writes, never version 0, until
an explicit :meth:`~dcr.adapters.commit.base.CommitStore.reset` names what it deletes and
empties the store.
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

from dcr.adapters.commit.base import INITIAL_RECORD, CommitState, CommitStore
from dcr.errors import CommitConflict, CommitStoreError
from dcr.protocol.types import CommitOutcome, CommitRecord

__all__ = ["CommitStoreMachine", "CommitStoreTests", "DurableCommitStoreTests", "ManualClock"]


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

    def test_a_fresh_store_reads_as_never_written(self) -> None:
        """A store never written holds the initial record, no coordinator epoch and no
        attempt."""

        async def main() -> CommitState:
            store = self.make_store(ManualClock())
            try:
                return await store.read()
            finally:
                await store.close()

        assert _empty(anyio.run(main))


def _empty(state: CommitState) -> bool:
    return (state.record, state.epoch, state.attempt) == (INITIAL_RECORD, 0, None)


class DurableCommitStoreTests(CommitStoreTests):
    """The suite of a durable store: :class:`CommitStoreTests` and the rule that a record
    never rewinds.  Give it :meth:`lose_record` too, and :meth:`reopen` where a restarted
    process opens the record through a new object."""

    async def lose_record(self, store: CommitStore) -> None:
        """Delete the stored record behind the store's back, as an operator, a cleanup script
        or an expiry rule would (whatever the store keeps beside the record stays)."""
        raise NotImplementedError(f"{type(self).__name__} must define lose_record(store)")

    def reopen(self, store: CommitStore, clock: ManualClock) -> CommitStore:
        """The store a process starting now opens on the same record (default: ``store``)."""
        return store

    def test_a_lost_record_is_an_error_never_a_rewind(self) -> None:
        """Losing a record never written changes nothing; losing one after a commit makes
        reads and writes fail with ``check="missing"`` (a message that names the reset),
        until ``reset`` deletes what is left: then the store reads as never written."""

        async def main() -> None:
            clock = ManualClock()
            opened = [self.make_store(clock)]
            try:
                await self.lose_record(opened[-1])
                opened.append(self.reopen(opened[-1], clock))
                store = opened[-1]
                assert _empty(await store.read())
                epoch = await store.claim()
                await store.register(epoch=epoch, attempt=1, base=INITIAL_RECORD)
                v1 = CommitRecord(version=1, candidate="g1")
                outcome = await store.compare_and_set(
                    epoch=epoch, attempt=1, expected=INITIAL_RECORD, new=v1,
                    deadline=clock.now + 30,
                )  # fmt: skip
                assert outcome is CommitOutcome.SUCCEEDED
                await self.lose_record(store)
                opened.append(self.reopen(store, clock))
                store = opened[-1]
                for op in (store.read, store.claim, store.read):
                    try:
                        await op()
                    except CommitStoreError as exc:
                        assert exc.check == "missing" and not exc.retryable, exc
                        assert "reset" in str(exc), exc
                    else:
                        raise AssertionError(f"{op.__name__} on a lost record did not fail")
                planned = await store.reset(dry_run=True)
                assert planned, "reset names nothing it would delete"
                try:
                    await store.read()
                except CommitStoreError as exc:
                    assert exc.check == "missing", exc
                else:
                    raise AssertionError("a dry run of reset deleted something")
                assert await store.reset() == planned
                assert _empty(await store.read())
                opened.append(self.reopen(store, clock))
                assert _empty(await opened[-1].read())
                assert await opened[-1].claim() == 1  # a fresh start: epochs begin again
            finally:
                for s in opened:
                    await s.close()

        anyio.run(main)

    def test_reset_names_what_it_deletes(self) -> None:
        """A store never written has nothing to reset; a written one's reset names what it
        deletes, and afterwards the record reads as never written, here and for a process
        that starts now, and losing it then is no error."""

        async def main() -> None:
            clock = ManualClock()
            opened = [self.make_store(clock)]
            try:
                store = opened[-1]
                assert await store.reset(dry_run=True) == []
                assert await store.reset() == []
                await store.claim()
                planned = await store.reset(dry_run=True)
                assert planned and (await store.read()).epoch == 1
                assert await store.reset() == planned
                assert _empty(await store.read())
                opened.append(self.reopen(store, clock))
                assert _empty(await opened[-1].read())
                await self.lose_record(opened[-1])
                opened.append(self.reopen(opened[-1], clock))
                assert _empty(await opened[-1].read())
            finally:
                for s in opened:
                    await s.close()

        anyio.run(main)
