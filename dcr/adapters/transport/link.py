"""An emulated network link: a per-node byte-rate limit for a transport's send and fetch paths.

On one host every transfer is a loopback memory copy, far faster than the link between a
training and a rollout cluster (paper §8.1: up to 5 Gbit/s per node across clusters).  A
:class:`LinkLimit` paces the bytes one node moves in one direction so that a measurement on
one host reflects that link: every transfer reserves its bytes on the link in arrival order
(a token bucket whose tokens are link time) and waits until the link has carried them.
Concurrent transfers of the node share the rate; one node's uplink and downlink are two
limits (links are full duplex).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from dcr.errors import ConfigError

__all__ = ["LinkLimit", "LinkStats"]

CHUNK = 1 << 20
"""Bytes reserved at a time by :meth:`LinkLimit.pace`, so concurrent transfers interleave."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStats:
    """What passed the link so far."""

    bytes: int = 0
    waited_s: float = 0.0
    """Seconds transfers spent waiting for the link, summed over transfers."""


class LinkLimit:
    """A node's link in one direction, ``gbps`` gigabits (10^9 bits) per second.

    ``gbps=None`` (or 0) is an unlimited link: :meth:`take` returns at once and only counts.
    ``burst_s`` is how far ahead of the link a transfer may run (the bucket's depth, in
    seconds of link time); a short burst keeps the rate smooth, a longer one absorbs
    scheduling jitter.
    """

    def __init__(
        self,
        gbps: float | None = None,
        *,
        burst_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if gbps is not None and gbps < 0:
            raise ConfigError(f"link rate must be >= 0 Gbit/s, got {gbps}")
        if burst_s < 0:
            raise ConfigError(f"burst_s must be >= 0, got {burst_s}")
        self.gbps = gbps or None
        self.burst_s = burst_s
        self._clock = clock
        self._free_at = 0.0
        """When the link has carried every byte reserved so far (clock seconds)."""
        self._bytes = 0
        self._waited = 0.0

    @property
    def bytes_per_s(self) -> float | None:
        """The rate in bytes per second, ``None`` when unlimited."""
        return None if self.gbps is None else self.gbps * 1e9 / 8

    async def take(self, nbytes: int) -> None:
        """Reserve ``nbytes`` on the link and wait until the link carried them (less the
        burst allowance).  Reservations are served in the order they were made."""
        if nbytes < 0:
            raise ConfigError(f"cannot take {nbytes} bytes")
        self._bytes += nbytes
        rate = self.bytes_per_s
        if rate is None or nbytes == 0:
            return
        now = self._clock()
        self._free_at = max(self._free_at, now) + nbytes / rate
        delay = self._free_at - now - self.burst_s
        if delay > 0:
            self._waited += delay
            await anyio.sleep(delay)

    async def pace(self, nbytes: int) -> None:
        """:meth:`take` ``nbytes`` in pieces of at most 1 MiB, so that transfers running at
        the same time share the link instead of queueing whole behind each other."""
        while nbytes > 0:
            piece = min(nbytes, CHUNK)
            await self.take(piece)
            nbytes -= piece

    def stats(self) -> LinkStats:
        return LinkStats(bytes=self._bytes, waited_s=self._waited)
