"""An in-memory commit store: one process, for tests and single-process setups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Self

from dcr.adapters.commit.base import INITIAL_RECORD, CommitState, CommitStore, Transaction
from dcr.errors import ConfigError
from dcr.protocol.types import CommitRecord

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["MemoryCommitStore"]


class MemoryCommitStore(CommitStore):
    """Commit state in a Python object guarded by a lock (not durable, not shared)."""

    def __init__(
        self,
        record: CommitRecord = INITIAL_RECORD,
        *,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.01,
    ) -> None:
        super().__init__(clock=clock, poll_s=poll_s)
        self._state = CommitState(record=record)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """Refused: every process would hold a record of its own."""
        raise ConfigError(
            f"[{context.section}]: the memory commit store keeps the record inside one process "
            "and does not reach other processes; use 'sqlite' (one host) or 's3'"
        )

    async def _transact(self, fn: Transaction) -> CommitState:
        with self._lock:
            new = fn(self._state)
            if new is not None:
                self._state = new
            return self._state
