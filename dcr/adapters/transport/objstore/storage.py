"""Storage operations as the object-storage transport runs them, and what they count.

Storage operations are retried with exponential backoff and full jitter when the backend
calls the error retryable (throttling such as S3's 503 SlowDown, 5xx, cut connections);
other errors, or the last retry's, surface as :class:`~dcr.errors.TransportError`.  Retries,
failures and a node's fetches are counted in :class:`FetchStats` (paper §8.7).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.objstore.backend import ObjectBackend, ObjectInfo
from dcr.adapters.transport.objstore.config import ObjectStoreConfig
from dcr.errors import TransportError

__all__ = ["FetchStats", "Storage"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchStats:
    """What a node fetched: the rollout side's view of the boundary (paper §8.7)."""

    traffic: TransportStats = field(default_factory=TransportStats)
    """V_cross (``cross_bytes``: every byte fetched) and V_payload (each payload key once)."""
    damaged: int = 0
    """Payloads whose stored length stayed different from their manifest entry (handed over
    as stored: the receiver's checks fail the attempt)."""
    missing: int = 0
    """Listed payloads storage no longer held (not delivered)."""
    bad_entries: int = 0
    """Manifest entries that did not decode, did not match their key or (with a fleet secret)
    whose seal did not verify (ignored)."""
    errors: int = 0
    """Listings and fetches that failed after every retry."""
    retried: int = 0
    """Storage operations tried again after a retryable error (sends included)."""
    shared: int = 0
    """Payloads read from the node's shared copies (``node_cache``) instead of storage."""
    last_error: str = ""


class Storage:
    """The backend as the sender and the fetcher use it: every operation retried (``retries``
    tries, backoff from ``backoff_s`` up to ``backoff_max_s``), and the :class:`FetchStats`
    counters that retries, failures and fetches feed."""

    def __init__(self, backend: ObjectBackend, config: ObjectStoreConfig) -> None:
        self.backend = backend
        self.config = config
        self.fetched = FetchStats()
        self._rng = random.Random()

    def count(self, **changes: Any) -> None:
        f = self.fetched
        self.fetched = FetchStats(
            traffic=changes.get("traffic", f.traffic),
            damaged=f.damaged + changes.get("damaged", 0),
            missing=f.missing + changes.get("missing", 0),
            bad_entries=f.bad_entries + changes.get("bad_entries", 0),
            errors=f.errors + changes.get("errors", 0),
            retried=f.retried + changes.get("retried", 0),
            shared=f.shared + changes.get("shared", 0),
            last_error=changes.get("last_error", f.last_error),
        )

    def backoff(self, i: int) -> float:
        c = self.config
        return self._rng.uniform(0, min(c.backoff_max_s, c.backoff_s * 2**i))

    async def retry(
        self, what: str, op: Callable[[], Awaitable[T]], *, attempt: int | None = None
    ) -> T:
        """Run a storage operation, retrying retryable errors with backoff (full jitter)."""
        tries = self.config.retries
        for i in range(tries):
            try:
                return await op()
            except TransportError as exc:
                if not exc.retryable or i == tries - 1:
                    raise TransportError(
                        f"{what} on {self.backend.describe()} failed after {i + 1} tries: "
                        f"{exc.message}",
                        retryable=exc.retryable,
                        attempt=attempt if attempt is not None else exc.attempt,
                        check=exc.check,
                    ) from exc
                self.count(retried=1)
                await anyio.sleep(self.backoff(i))
        raise AssertionError("unreachable")

    async def list(self, prefix: str, attempt: int | None = None) -> list[ObjectInfo]:
        return await self.retry(f"listing {prefix}", lambda: self.backend.list(prefix),
                                attempt=attempt)  # fmt: skip
