"""What every engine process shares: the fixed integration setup and small helpers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import anyio
from anyio.abc import TaskStatus

from dcr.errors import ConfigError
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode
from dcr.tensors.parallel import default_threads
from dcr.tensors.records import TensorSpec
from dcr.wire.payload import DecodeLimits, ValueLayout

__all__ = [
    "Integration",
    "attempt_from_json",
    "attempt_to_json",
    "default_limiter",
    "serving",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Integration:
    """The integration setup ``M`` (paper App. A.1, fixed during a transition).

    ``catalog``: canonical names, shapes, dtypes.  ``xor_names``: tensors owners may
    encode relative to the old bits in mixed mode when a prepare binds no refused set of its
    own (:attr:`~dcr.protocol.messages.Prepare.xor_refused`, from the receivers' status
    reports): every receiver's loader path must preserve their bits, and receivers reject a
    prepare when it is not so for them.  Where the setup is known (in-process refits) it is
    the default; ``frozenset()`` sends everything as overwrites unless a prepare says
    otherwise.  ``owner_ids``: owner name -> the owner id carried in payload headers.
    """

    catalog: Mapping[str, TensorSpec]
    xor_names: frozenset[str]
    owner_ids: Mapping[str, int]
    zstd_level: int = 1
    value_layout: ValueLayout = ValueLayout.BYTEPLANE
    limits: DecodeLimits = field(default_factory=DecodeLimits)

    def __post_init__(self) -> None:
        unknown = self.xor_names - set(self.catalog)
        if unknown:
            raise ConfigError(f"xor_names outside the catalog: {sorted(unknown)[:5]}")
        if len(set(self.owner_ids.values())) != len(self.owner_ids):
            raise ConfigError("owner ids must be distinct")


def attempt_to_json(info: AttemptInfo) -> str:
    """Serialize what prepare bound, so that a coordinator taking over can resume it."""
    return json.dumps(
        {
            "attempt": info.attempt,
            "candidate": info.candidate,
            "base": [info.base.version, info.base.candidate],
            "mode": info.mode.value,
            "sync": info.sync,
            "coordinator": info.coordinator,
            "owners": list(info.owners),
            "receivers": sorted(info.receivers),
        },
        sort_keys=True,
    )


def attempt_from_json(text: str) -> AttemptInfo:
    """Inverse of :func:`attempt_to_json`; raises :class:`ConfigError` on malformed input."""
    try:
        d = json.loads(text)
        return AttemptInfo(
            attempt=int(d["attempt"]),
            candidate=str(d["candidate"]),
            base=CommitRecord(version=int(d["base"][0]), candidate=str(d["base"][1])),
            mode=Mode(d["mode"]),
            sync=bool(d["sync"]),
            coordinator=int(d["coordinator"]),
            owners=tuple(str(o) for o in d["owners"]),
            receivers=frozenset(str(r) for r in d["receivers"]),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"malformed attempt record: {exc}") from exc


def default_limiter() -> anyio.CapacityLimiter:
    """Worker threads for CPU-heavy engine work (diff, encode, zstd, decode, apply)."""
    return anyio.CapacityLimiter(max(2, default_threads()))


class _Serves(Protocol):
    async def serve(self, *, task_status: TaskStatus[None] = ...) -> None: ...


S = TypeVar("S", bound=_Serves)


@asynccontextmanager
async def serving(service: S) -> AsyncIterator[S]:
    """Serve an endpoint service for the duration of the block, in a task group of its own
    (what :func:`~dcr.engine.owner.open_owner` and :func:`~dcr.engine.receiver.open_receiver`
    do once they built theirs)."""
    async with anyio.create_task_group() as tg:
        await tg.start(service.serve)
        try:
            yield service
        finally:
            tg.cancel_scope.cancel()
