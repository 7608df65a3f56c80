"""The SQLite commit store: the embedded default control plane.

One database file holds the commit record of any number of named policies.  Every operation
that may write is one ``BEGIN IMMEDIATE`` transaction (the database's write lock), and the write
is an ``UPDATE ... WHERE revision = ?`` whose row count proves no other writer got in between, so
compare-and-set is correct across threads and processes sharing the file (WAL mode).  A plain
:meth:`~SqliteCommitStore.read` is one ``SELECT`` on a kept connection: a consistent snapshot
without the write lock, cheap enough for every endpoint to watch the record several times a
second.

**The record never rewinds.**  After its first write, a store object leaves a marker file
beside the database (``<path>.written``).  A database file that is then missing, or was
created again without the table, is a :func:`~dcr.adapters.commit.base.record_missing` error,
on reads and writes alike, not a fresh record at version 0; :meth:`SqliteCommitStore.reset`
(``dcr commit-store reset``) is the way back to the empty state.  A policy name without a row
in an intact database is simply a new policy (its row is created).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio

from dcr.adapters.commit.base import (
    INITIAL_RECORD,
    CommitState,
    CommitStore,
    Transaction,
    record_missing,
)
from dcr.adapters.context import known_options
from dcr.errors import CommitStoreError, ConfigError
from dcr.protocol.types import CommitRecord

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["SqliteCommitStore"]

MARKER_SUFFIX = ".written"
"""The marker file beside the database: ``<path>.written``."""

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
    long an operation waits for the database lock.  Once written, a lost database is an
    error (see the module's docstring).
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
        self.marker = self.path.with_name(self.path.name + MARKER_SUFFIX)
        self._marked = False
        """Whether this object has written the marker."""
        self._lost = False
        """The database was lost after a write (the marker stays)."""
        try:
            self._present(opening=True)
        except CommitStoreError as exc:
            if exc.check != "missing":
                raise  # a lost record is raised by every operation but reset

    def _lost_error(self) -> CommitStoreError | None:
        """The :func:`record_missing` error where the database was lost after a write (the
        marker is there, the table is not); raises :class:`sqlite3.Error`."""
        if not self.marker.exists():
            return None
        if self.path.exists():
            with contextlib.closing(self._connect()) as db:
                if db.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'dcr_commit'"
                ).fetchall():
                    return None
        self._lost = True
        return record_missing(str(self.path), f"its marker {self.marker} says a fleet wrote it")

    def _failed(self, exc: sqlite3.Error) -> CommitStoreError:
        """The error of an operation that failed with ``exc``: a lost record if the database
        was created again meanwhile, else a retryable error."""
        try:
            lost = self._lost_error()
        except sqlite3.Error:
            lost = None
        return lost or CommitStoreError(f"{self.path}: {exc}", retryable=True)

    def _present(self, *, opening: bool = False) -> None:
        """Check that the database is there (``opening``: that it holds the table too),
        creating the table and this policy's row where the store was never written; raise
        :func:`record_missing` where it was written and is gone.  A database another process
        holds locked (SQLite does not always wait for it: recovering the WAL index after a
        process was killed, say) is tried again until ``timeout_s``."""
        if not opening and not self._lost and self.path.exists():
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self._open()
                return
            except CommitStoreError as exc:
                cause = exc.__cause__
                locked = isinstance(cause, sqlite3.OperationalError) and any(
                    word in str(cause).lower() for word in ("locked", "busy")
                )
                if not locked or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def _open(self) -> None:
        """One try of :meth:`_present`."""
        try:
            lost = self._lost_error()
        except sqlite3.Error as exc:
            raise CommitStoreError(f"cannot open {self.path}: {exc}", retryable=False) from exc
        if lost is not None:
            raise lost
        self._lost = False
        try:
            with contextlib.closing(self._connect()) as db:
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
                    (self.name, self._initial.version, self._initial.candidate),
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
            self._present()
            try:
                if self._reader is None:
                    self._reader = self._connect(shared=True)
                rows = self._reader.execute(self._SELECT, (self.name,)).fetchall()
            except sqlite3.Error as exc:
                self._drop_reader()
                raise self._failed(exc) from exc
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
        self._present()
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
            self._mark()
            return new
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise self._failed(exc) from exc
        finally:
            db.close()

    async def _transact(self, fn: Transaction) -> CommitState:
        return await anyio.to_thread.run_sync(self._run, fn)

    def _mark(self) -> None:
        """Leave the marker after this object's first write."""
        if self._marked:
            return
        try:
            self.marker.write_text(
                f"{self.path.name} holds a dcr commit record: while this file exists, a missing "
                f"{self.path.name} is an error, not a fresh record at version 0 "
                "(`dcr commit-store reset` deletes both)\n"
            )
        except OSError as exc:
            raise CommitStoreError(
                f"{self.path} was written, but its marker {self.marker} was not: {exc}",
                retryable=True,
                check="write",
            ) from exc
        self._marked = True

    def __repr__(self) -> str:
        return f"SqliteCommitStore({self.path}, name={self.name!r})"

    async def reset(self, *, dry_run: bool = False) -> list[str]:
        """Delete this policy's row (another one is created at version 0) and, when no other
        policy's row is left, the marker: the store reads as never written.  An operator's
        command (``dcr commit-store reset``), never while a fleet uses the record.  Returns
        what it deleted (``dry_run``: would delete)."""
        return await anyio.to_thread.run_sync(self._reset, dry_run)

    def _reset(self, dry_run: bool) -> list[str]:
        deleted: list[str] = []
        others = 0
        with self._reader_lock:
            self._drop_reader()
            db = self._connect() if self.path.exists() else None
            try:
                if db is not None:
                    db.execute("BEGIN IMMEDIATE")
                    if db.execute(
                        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'dcr_commit'"
                    ).fetchall():
                        row = db.execute(
                            "SELECT revision FROM dcr_commit WHERE name = ?", (self.name,)
                        ).fetchone()
                        (others,) = db.execute(
                            "SELECT COUNT(*) FROM dcr_commit WHERE name != ? AND revision > 0",
                            (self.name,),
                        ).fetchone()
                        if row is not None and row[0] > 0:
                            deleted.append(f"{self.path} (the record {self.name!r})")
                            if not dry_run:
                                db.execute("DELETE FROM dcr_commit WHERE name = ?", (self.name,))
                                db.execute(
                                    "INSERT INTO dcr_commit (name, version, candidate, epoch, "
                                    "attempt, deadline, obsolete, info, revision) "
                                    "VALUES (?, ?, ?, 0, NULL, NULL, '[]', '', 0)",
                                    (self.name, self._initial.version, self._initial.candidate),
                                )
                    db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db is not None and db.in_transaction:
                    db.execute("ROLLBACK")
                raise CommitStoreError(f"resetting {self.path}: {exc}", retryable=True,
                                       check="write") from exc  # fmt: skip
            finally:
                if db is not None:
                    db.close()
            if self.marker.exists() and not others:
                deleted.append(str(self.marker))
                if not dry_run:
                    self.marker.unlink(missing_ok=True)
            if not dry_run:
                self._marked = False
                self._present(opening=True)
        return deleted
