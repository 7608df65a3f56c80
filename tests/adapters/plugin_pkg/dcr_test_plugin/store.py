"""``jsonfile``: the commit record as a JSON file, changed under an exclusive file lock.

A third party's commit store: every transaction takes ``flock`` on ``<file>.lock``, reads the
record, applies the change and replaces the file atomically, so compare-and-set holds across
the processes of one host.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import anyio

from dcr.adapters.commit.base import INITIAL_RECORD, CommitState, CommitStore, Transaction
from dcr.adapters.context import AdapterContext, known_options
from dcr.errors import ConfigError
from dcr.protocol.types import CommitRecord

__all__ = ["JsonFileCommitStore"]


class JsonFileCommitStore(CommitStore):
    """The commit record in the JSON file ``path``."""

    def __init__(self, path: str | Path, *, poll_s: float = 0.05) -> None:
        super().__init__(poll_s=poll_s)
        self.path = Path(path)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        opts = known_options(options, ("file", "poll_s"), context.section)
        name = opts.pop("file", "commit.json")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"[{context.section}]: file must be a file name")
        context.run_dir.mkdir(parents=True, exist_ok=True)
        return cls(context.run_dir / name, **opts)

    def _load(self) -> CommitState:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return CommitState(record=INITIAL_RECORD)
        return CommitState(
            record=CommitRecord(version=raw["version"], candidate=raw["candidate"]),
            epoch=raw["epoch"],
            attempt=raw["attempt"],
            deadline=raw["deadline"],
            obsolete=frozenset(raw["obsolete"]),
            info=raw["info"],
            address=raw["address"],
            lease=raw["lease"],
            revision=raw["revision"],
        )

    def _store(self, s: CommitState) -> None:
        body = {
            "version": s.record.version,
            "candidate": s.record.candidate,
            "epoch": s.epoch,
            "attempt": s.attempt,
            "deadline": s.deadline,
            "obsolete": sorted(s.obsolete),
            "info": s.info,
            "address": s.address,
            "lease": s.lease,
            "revision": s.revision,
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)

    def _run(self, fn: Transaction) -> CommitState:
        with self._lock, open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._load()
            new = fn(state)
            if new is None:
                return state
            self._store(new)
            return new

    async def _transact(self, fn: Transaction) -> CommitState:
        return await anyio.to_thread.run_sync(self._run, fn)
