"""Commit stores: the durable commit record, changed only by compare-and-set."""

from dcr.adapters.commit.base import CommitState as CommitState
from dcr.adapters.commit.base import CommitStore as CommitStore
from dcr.adapters.commit.memory import MemoryCommitStore as MemoryCommitStore
from dcr.adapters.commit.sqlite import SqliteCommitStore as SqliteCommitStore

__all__ = ["CommitState", "CommitStore", "MemoryCommitStore", "SqliteCommitStore"]
