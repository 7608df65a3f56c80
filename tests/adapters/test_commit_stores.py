"""Every commit store runs the conformance suite (its state machine); SQLite also races real
processes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import anyio
import pytest
from hypothesis import settings

from dcr.adapters.commit import CommitStore, MemoryCommitStore, SqliteCommitStore
from dcr.adapters.registry import available, load, register
from dcr.errors import CommitConflict, ConfigError
from dcr.protocol.types import CommitOutcome, CommitRecord
from dcr.testing.commit_store import CommitStoreMachine, CommitStoreTests, ManualClock

G0 = CommitRecord(version=0, candidate="g0")


class TestMemoryStore(CommitStoreTests):
    def make_store(self, clock: ManualClock) -> CommitStore:
        return MemoryCommitStore(clock=clock)


class TestSqliteStore(CommitStoreTests):
    def make_store(self, clock: ManualClock) -> CommitStore:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="dcr-sqlite-")) / "commit.db"
        return SqliteCommitStore(path, clock=clock)


def _race(path: str, tag: int, start, results) -> None:  # runs in a child process
    async def main() -> CommitOutcome:
        store = SqliteCommitStore(path)
        state = await store.read()
        start.wait()
        return await store.compare_and_set(
            epoch=state.epoch,
            attempt=7,
            expected=CommitRecord(version=0, candidate="g0"),
            new=CommitRecord(version=1, candidate=f"g7-{tag}"),
            deadline=1e12,
        )

    results.put((tag, anyio.run(main).value))


def test_sqlite_compare_and_set_has_one_winner_across_processes(tmp_path):
    """Eight processes race different records from the same expected one: exactly one wins."""
    path = str(tmp_path / "commit.db")

    async def setup() -> None:
        store = SqliteCommitStore(path)
        epoch = await store.claim()
        await store.register(epoch=epoch, attempt=7, base=CommitRecord(version=0, candidate="g0"))

    anyio.run(setup)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(path, tag, start, results)) for tag in range(8)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    outcomes = dict(results.get(timeout=5) for _ in procs)
    winners = [tag for tag, o in outcomes.items() if o == "succeeded"]
    assert len(winners) == 1
    assert all(o == "conflict" for tag, o in outcomes.items() if tag != winners[0])
    record = anyio.run(lambda: SqliteCommitStore(path).read()).record
    assert record == CommitRecord(version=1, candidate=f"g7-{winners[0]}")


def test_sqlite_reads_see_every_write_and_never_wait_for_the_write_lock(tmp_path):
    """Endpoints watch the record several times a second: a read is a snapshot that a writer
    holding the lock does not block, and it sees each committed write of another store."""
    import sqlite3

    path = tmp_path / "c.db"

    async def main() -> None:
        watcher, writer = SqliteCommitStore(path, timeout_s=30.0), SqliteCommitStore(path)
        assert (await watcher.read()).epoch == 0
        for n in range(1, 4):
            assert await writer.claim() == n
            assert (await watcher.read()).epoch == n
        held = sqlite3.connect(path, isolation_level=None)
        held.execute("BEGIN IMMEDIATE")  # another process mid-transaction
        try:
            with anyio.fail_after(10):  # far below the 30 s lock timeout a write would wait
                assert (await watcher.read()).epoch == 3
        finally:
            held.execute("ROLLBACK")
            held.close()
        await watcher.close()
        assert (await watcher.read()).epoch == 3  # reopens after close
        await watcher.close()
        await writer.close()

    anyio.run(main)


def test_stale_epoch_cannot_register_or_commit(tmp_path):
    async def main() -> None:
        store = SqliteCommitStore(tmp_path / "c.db")
        old = await store.claim()
        await store.register(epoch=old, attempt=1, base=G0)
        new = await store.claim()  # failover
        with pytest.raises(CommitConflict):
            await store.register(epoch=old, attempt=2, base=G0)
        outcome = await store.compare_and_set(
            epoch=old,
            attempt=1,
            expected=CommitRecord(version=0, candidate="g0"),
            new=CommitRecord(version=1, candidate="g1"),
            deadline=1e12,
        )
        assert outcome is CommitOutcome.CONFLICT
        await store.register(epoch=new, attempt=3, base=G0, info="x")
        state = await store.read()
        assert (state.attempt, state.info) == (3, "x")
        with pytest.raises(CommitConflict):  # the record moved on: the prepare is stale
            await store.register(epoch=new, attempt=4, base=CommitRecord(version=5, candidate="g5"))

    anyio.run(main)


def test_read_commit_waits_for_the_deadline():
    clock = ManualClock()

    async def main() -> None:
        store = MemoryCommitStore(clock=clock, poll_s=0.001)
        epoch = await store.claim()
        await store.register(epoch=epoch, attempt=1, base=G0)
        done: list[CommitRecord] = []

        async def reader() -> None:
            done.append(await store.read_commit(attempt=1, deadline=clock.now + 10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.02)
            assert not done  # still inside the deadline: a commit of attempt 1 could land
            clock.now += 11
        assert done == [CommitRecord(version=0, candidate="g0")]
        # an obsolete attempt resolves at once
        await store.mark_obsolete(attempt=1)
        assert await store.read_commit(attempt=1, deadline=clock.now + 1e6) == done[0]

    anyio.run(main)


def test_registry():
    assert {"memory", "sqlite"} <= set(available("commit_store"))
    assert load("commit_store", "sqlite") is SqliteCommitStore
    with pytest.raises(ConfigError):
        register("commit_store", "memory", "dcr.adapters.commit.memory:MemoryCommitStore")
    with pytest.raises(ConfigError, match="available"):
        load("commit_store", "nope")


class _IgnoresObsolete(MemoryCommitStore):
    async def mark_obsolete(self, *, attempt: int) -> None:
        return None


def test_the_conformance_machine_catches_a_broken_store():
    from hypothesis.stateful import run_state_machine_as_test

    machine = CommitStoreMachine.for_store(lambda clock: _IgnoresObsolete(clock=clock))
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(max_examples=200, deadline=None, database=None)
        )
