"""Every commit store runs the conformance suite (its state machine; SQLite also the rule that a
record never rewinds); SQLite also races real processes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import anyio
import pytest
from hypothesis import settings

from dcr.adapters.commit import CommitStore, MemoryCommitStore, SqliteCommitStore
from dcr.adapters.registry import available, load, register
from dcr.errors import CommitConflict, CommitStoreError, ConfigError
from dcr.protocol.types import CommitOutcome, CommitRecord
from dcr.testing.commit_store import (
    CommitStoreMachine,
    CommitStoreTests,
    DurableCommitStoreTests,
    ManualClock,
)

G0 = CommitRecord(version=0, candidate="g0")


class TestMemoryStore(CommitStoreTests):
    def make_store(self, clock: ManualClock) -> CommitStore:
        return MemoryCommitStore(clock=clock)


class TestSqliteStore(DurableCommitStoreTests):
    def make_store(self, clock: ManualClock) -> CommitStore:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="dcr-sqlite-")) / "commit.db"
        return SqliteCommitStore(path, clock=clock)

    async def lose_record(self, store: CommitStore) -> None:
        assert isinstance(store, SqliteCommitStore)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{store.path}{suffix}").unlink(missing_ok=True)

    def reopen(self, store: CommitStore, clock: ManualClock) -> CommitStore:
        assert isinstance(store, SqliteCommitStore)
        return SqliteCommitStore(store.path, clock=clock)


def test_sqlite_a_database_created_again_empty_is_a_lost_record(tmp_path: Path) -> None:
    """A database file deleted and created again without the table (a stray connection to
    the path) is a lost record too, and the store object that wrote it notices as well; a
    policy without a row in an intact database is simply new."""
    import sqlite3

    path = tmp_path / "commit.db"

    async def main() -> None:
        store = SqliteCommitStore(path)
        await store.claim()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        sqlite3.connect(path).close()  # an empty file at the path
        for opened in (store, SqliteCommitStore(path)):
            with pytest.raises(CommitStoreError) as exc:
                await opened.read()
            assert exc.value.check == "missing" and str(path) in str(exc.value)
        other = SqliteCommitStore(tmp_path / "other.db")
        await other.claim()
        assert (await SqliteCommitStore(tmp_path / "other.db", name="second").read()).epoch == 0

    anyio.run(main)


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


FLEET = """
[model]
size_mb = 0
refits = 2

[[rollout]]
name = "a"
receivers = [{ name = "r0", tp = 1, rank = 0 }]
"""


def test_the_reset_command_names_what_it_deletes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dcr commit-store``: a database lost after a commit stops ``show`` with the missing
    record and the command that resets it; ``reset --dry-run`` names what ``reset`` then
    deletes; a coordinator's running lease refuses the reset unless ``--force``."""
    import json

    from dcr import cli
    from dcr.fleet.config import load_fleet
    from dcr.fleet.runtime import make_store

    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    cfg = load_fleet(fleet)

    async def claim(lease_s: float | None) -> None:
        store = make_store(cfg)
        try:
            await store.claim(address="tcp://127.0.0.1:1", lease_s=lease_s)
        finally:
            await store.close()

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["commit-store", *argv, "--fleet", str(fleet)])
        out, err = capsys.readouterr()
        return code, out, err

    db = cfg.run_dir / "commit.db"
    marker = f"{db}.written"
    anyio.run(claim, None)
    assert json.loads(run("show", "--json")[1])["epoch"] == 1
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    code, _, err = run("show")
    assert code == 2 and "missing" in err and "dcr commit-store reset" in err
    code, out, _ = run("reset", "--dry-run")
    assert code == 0 and out.splitlines() == [f"would delete {marker}"]
    assert run("show")[0] == 2  # a dry run deletes nothing
    code, out, _ = run("reset", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [marker]
    assert json.loads(run("show", "--json")[1])["version"] == 0
    anyio.run(claim, 600.0)
    code, _, err = run("reset")
    assert code == 2 and "lease" in err and "--force" in err
    code, out, _ = run("reset", "--force")
    assert code == 0 and out.splitlines() == [
        f"deleted {db} (the record 'policy')",
        f"deleted {marker}",
    ]
    state = json.loads(run("show", "--json")[1])
    assert (state["version"], state["epoch"]) == (0, 0)


def test_a_sqlite_store_opened_while_another_process_holds_it_locked_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite does not always wait for a lock itself (recovering the WAL index after a killed
    process): opening the store tries again until ``timeout_s`` instead of failing at once,
    and a lock past ``timeout_s`` is still an error that names the database."""
    import sqlite3

    SqliteCommitStore(tmp_path / "commit.db")  # the fleet's database exists
    real = SqliteCommitStore._connect
    failures = [2]

    def connect(self: SqliteCommitStore, *, shared: bool = False) -> sqlite3.Connection:
        if failures[0] > 0:
            failures[0] -= 1
            raise sqlite3.OperationalError("database is locked")
        return real(self, shared=shared)

    monkeypatch.setattr(SqliteCommitStore, "_connect", connect)
    store = SqliteCommitStore(tmp_path / "commit.db")
    assert failures == [0] and store.path == tmp_path / "commit.db"
    failures[0] = 10**6
    with pytest.raises(CommitStoreError, match="database is locked"):
        SqliteCommitStore(tmp_path / "commit.db", timeout_s=0.2)
