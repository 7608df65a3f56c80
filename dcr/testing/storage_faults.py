"""Storage faults behind the object-store backend interface, for tests and demos.

:class:`FaultyBackend` wraps a real :class:`~dcr.adapters.transport.objstore.ObjectBackend`
(S3, a directory) and misbehaves as a :class:`StorageFaults` plan says, in the first attempt
whose payload it sees uploaded (the *struck* attempt; later attempts -- the overwrite retries
-- run clean): payload uploads throttled (an S3 503 SlowDown, retryable), payload fetches cut
mid-transfer (a connection reset, retryable), payloads stored shorter than sent, manifest
entries the writer believes posted but storage never kept, and payloads uploaded again by a
straggler after the attempt was stopped and cleaned up (a writer in another process whose
request lands late, its checks skipped).  :attr:`FaultyBackend.log` counts what struck.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio

from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore import ObjectBackend, ObjectInfo, tombstone_key
from dcr.errors import ConfigError, TransportError

__all__ = ["FaultyBackend", "StorageFaultLog", "StorageFaults"]

_ATTEMPT = re.compile(r"^(?:payload|manifest)/(\d{20})/")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageFaults:
    """How many operations of the struck attempt go wrong, per kind (all default to 0)."""

    throttle: int = 0
    """Payload uploads answered with 503 SlowDown (each answer is one failed try)."""
    reset: int = 0
    """Payload fetches whose connection is reset (each reset is one failed try)."""
    truncate: int = 0
    """Payloads stored with only the first half of their bytes (the object stays damaged)."""
    drop_entry: int = 0
    """Manifest entries acknowledged to the writer but never stored."""
    late_upload: int = 0
    """Payloads (with their manifest entries) written again by a straggler once the
    attempt's objects were cleaned up."""

    def __post_init__(self) -> None:
        for name in ("throttle", "reset", "truncate", "drop_entry", "late_upload"):
            if getattr(self, name) < 0:
                raise ConfigError(f"StorageFaults.{name} must be >= 0")


@dataclass(slots=True)
class StorageFaultLog:
    """What the faults did."""

    attempt: int | None = None
    """The struck attempt."""
    throttled: int = 0
    reset: int = 0
    truncated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)
    """Keys the straggler wrote after the attempt was cleaned up."""
    fetched: list[str] = field(default_factory=list)
    """Every payload key fetched through this backend, in order."""
    landed_at: int | None = None
    """How many fetches :attr:`fetched` held when the straggler began to write."""


class FaultyBackend(ObjectBackend):
    """``inner`` with the faults of ``plan`` struck in the first attempt that uploads."""

    def __init__(self, inner: ObjectBackend, plan: StorageFaults) -> None:
        self.inner = inner
        self.plan = plan
        self.log = StorageFaultLog()
        self._left = {
            "throttle": plan.throttle,
            "reset": plan.reset,
            "truncate": plan.truncate,
            "drop_entry": plan.drop_entry,
            "late_upload": plan.late_upload,
        }
        self._held: list[tuple[str, bytes]] = []
        """Payloads the straggler writes again (its manifest entries follow them)."""
        self._straggler: asyncio.Task[None] | None = None

    def describe(self) -> str:
        return f"faulty {self.inner.describe()}"

    def _struck(self, key: str) -> bool:
        m = _ATTEMPT.match(key)
        if m is None:
            return False
        attempt = int(m[1])
        if self.log.attempt is None and key.startswith("payload/"):
            self.log.attempt = attempt
        return attempt == self.log.attempt

    def _take(self, kind: str) -> bool:
        if self._left[kind] > 0:
            self._left[kind] -= 1
            return True
        return False

    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        struck = self._struck(key)
        if struck and key.startswith("payload/"):
            if self._take("throttle"):
                self.log.throttled += 1
                raise TransportError(f"PUT {key}: SlowDown (503, injected)", retryable=True,
                                     check="throttled")  # fmt: skip
            if self._take("late_upload"):
                self._held.append((key, data))
            if self._take("truncate"):
                self.log.truncated.append(key)
                data = data[: len(data) // 2]
        if struck and "/e/" in key:
            if any(_tail(k) == _tail(key) for k, _ in self._held):
                self._held.append((key, data))
            if self._take("drop_entry"):
                self.log.dropped.append(key)
                return  # acknowledged, never stored
        await self.inner.put(key, data, link=link)

    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        if key.startswith("payload/"):
            self.log.fetched.append(key)
            if self._struck(key) and self._take("reset"):
                self.log.reset += 1
                raise TransportError(f"GET {key}: connection reset by peer (injected)",
                                     retryable=True, check="connection")  # fmt: skip
        return await self.inner.get(key, link=link)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)
        attempt = self.log.attempt
        if (
            attempt is not None
            and self._held
            and self._straggler is None
            and any(k.startswith(f"payload/{attempt:020d}/") for k in keys)
        ):
            # The attempt was cleaned up: the straggler's request lands now.
            self._straggler = asyncio.get_running_loop().create_task(self._land(attempt))

    async def _land(self, attempt: int) -> None:
        await anyio.sleep(0.05)
        assert await self.inner.get(tombstone_key(attempt)) is not None
        self.log.landed_at = len(self.log.fetched)
        for key, data in self._held:
            await self.inner.put(key, data)
            self.log.late.append(key)

    async def abort_uploads(self, prefix: str) -> None:
        await self.inner.abort_uploads(prefix)

    async def settled(self) -> None:
        """Wait for the straggler's writes (if it was set off)."""
        if self._straggler is not None:
            await self._straggler

    async def aclose(self) -> None:
        if self._straggler is not None and not self._straggler.done():
            self._straggler.cancel()
        await self.inner.aclose()


def _tail(key: str) -> str:
    """``<attempt>/<owner>/<writer>.<seq>`` of a payload or manifest-entry key."""
    parts = key.split("/")
    return "/".join(p for p in parts[1:] if p != "e")
