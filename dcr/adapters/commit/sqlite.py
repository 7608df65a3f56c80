"""The SQLite commit store: the embedded default control plane.

One database file holds the commit record of any number of named policies.  Every operation
that may write is one ``BEGIN IMMEDIATE`` transaction (the database's write lock), and the write
is an ``UPDATE ... WHERE revision = ?`` whose row count proves no other writer got in between, so
compare-and-set is correct across threads and processes sharing the file (WAL mode).  A plain
:meth:`~SqliteCommitStore.read` is one ``SELECT`` on a kept connection: a consistent snapshot
without the write lock, cheap enough for every endpoint to watch the record several times a
second.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio

from dcr.adapters.commit.base import INITIAL_RECORD, CommitState, CommitStore, Transaction
from dcr.adapters.context import known_options
from dcr.errors import CommitStoreError, ConfigError
from dcr.protocol.types import CommitRecord

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["SqliteCommitStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dcr_commit (
    name      TEXT PRIMARY KEY,
    version   INTEGER NOT NULL,
    candidate TEXT NOT NULL,
    epoch     INTEGER NOT NULL,
    attempt   INTEGER,
    deadline  REAL,
    obsolete  TEXT NOT NULL,
    info      TEXT NOT NULL,
    revision  INTEGER NOT NULL,
    address   TEXT NOT NULL DEFAULT '',
    lease     REAL
)
"""


class SqliteCommitStore(CommitStore):
    """Commit state in the SQLite database at ``path`` under ``name``.

    A missing row is created with ``record`` (default: version 0).  ``timeout_s`` bounds how
    long an operation waits for the database lock.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        name: str = "policy",
        record: CommitRecord = INITIAL_RECORD,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.05,
    ) -> None:
        super().__init__(clock=clock, poll_s=poll_s)
        self.path = Path(path)
        self.name = name
        self.timeout_s = timeout_s
        self._initial = record
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        try:
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_SCHEMA)
                columns = {row[1] for row in db.execute("PRAGMA table_info(dcr_commit)")}
                if "address" not in columns:  # a database written before coordinator leases
                    db.execute("ALTER TABLE dcr_commit ADD COLUMN address TEXT NOT NULL DEFAULT ''")
                    db.execute("ALTER TABLE dcr_commit ADD COLUMN lease REAL")
                db.execute(
                    "INSERT OR IGNORE INTO dcr_commit (name, version, candidate, epoch, attempt, "
                    "deadline, obsolete, info, revision) "
                    "VALUES (?, ?, ?, 0, NULL, NULL, '[]', '', 0)",
                    (name, record.version, record.candidate),
                )
        except sqlite3.Error as exc:
            raise CommitStoreError(f"cannot open {self.path}: {exc}", retryable=False) from exc

    OPTIONS = ("path", "name", "timeout_s", "poll_s")
    """Keys of a fleet file's ``[commit_store]`` section for this store."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The database ``path`` (relative to the run directory; default ``commit.db``), so
        every process of a fleet on one host opens the same file.  The run directory is
        created if needed."""
        opts = known_options(options, cls.OPTIONS, context.section)
        path = opts.pop("path", "commit.db")
        if not isinstance(path, str | Path) or not str(path):
            raise ConfigError(f"[{context.section}]: path must be a file name, got {path!r}")
        try:
            context.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory {context.run_dir}: {exc}") from exc
        try:
            return cls(context.run_dir / path, **opts)
        except TypeError as exc:
            raise ConfigError(f"[{context.section}]: {exc}") from exc

    def _connect(self, *, shared: bool = False) -> sqlite3.Connection:
        """A connection in autocommit mode; ``shared`` lets other threads use it (under
        the caller's lock)."""
        return sqlite3.connect(
            self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=not shared
        )

    _SELECT = (
        "SELECT version, candidate, epoch, attempt, deadline, obsolete, info, revision, "
        "address, lease FROM dcr_commit WHERE name = ?"
    )

    def _state(self, row: Any) -> CommitState:
        if row is None:
            raise CommitStoreError(f"no commit record named {self.name!r}", retryable=False)
        return CommitState(
            record=CommitRecord(version=row[0], candidate=row[1]),
            epoch=row[2],
            attempt=row[3],
            deadline=row[4],
            obsolete=frozenset(json.loads(row[5])),
            info=row[6],
            revision=row[7],
            address=row[8],
            lease=row[9],
        )

    def _read(self) -> CommitState:
        """One ``SELECT`` on the kept connection (opened on first use, dropped on an error):
        every statement runs to its end, so no read transaction stays open between calls."""
        with self._reader_lock:
            try:
                if self._reader is None:
                    self._reader = self._connect(shared=True)
                rows = self._reader.execute(self._SELECT, (self.name,)).fetchall()
            except sqlite3.Error as exc:
                self._drop_reader()
                raise CommitStoreError(f"{self.path}: {exc}", retryable=True) from exc
        return self._state(rows[0] if rows else None)

    def _drop_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    async def read(self) -> CommitState:
        return await anyio.to_thread.run_sync(self._read)

    async def close(self) -> None:
        with self._reader_lock:
            self._drop_reader()

    def _run(self, fn: Transaction) -> CommitState:
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(self._SELECT, (self.name,)).fetchone()
            state = self._state(row)
            new = fn(state)
            if new is None:
                db.execute("COMMIT")
                return state
            cur = db.execute(
                "UPDATE dcr_commit SET version = ?, candidate = ?, epoch = ?, attempt = ?, "
                "deadline = ?, obsolete = ?, info = ?, revision = ?, address = ?, lease = ? "
                "WHERE name = ? AND revision = ?",
                (
                    new.record.version,
                    new.record.candidate,
                    new.epoch,
                    new.attempt,
                    new.deadline,
                    json.dumps(sorted(new.obsolete)),
                    new.info,
                    new.revision,
                    new.address,
                    new.lease,
                    self.name,
                    state.revision,
                ),
            )
            if cur.rowcount != 1:
                raise CommitStoreError("the commit record changed under the lock", retryable=True)
            db.execute("COMMIT")
            return new
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise CommitStoreError(f"{self.path}: {exc}", retryable=True) from exc
        finally:
            db.close()

    async def _transact(self, fn: Transaction) -> CommitState:
        return await anyio.to_thread.run_sync(self._run, fn)
