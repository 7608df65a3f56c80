"""The in-memory transport runs the transport conformance suite."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import ClassVar

import pytest

from dcr.adapters.registry import load
from dcr.adapters.transport import MemoryTransport
from dcr.adapters.transport.base import Transport, TransportStats
from dcr.testing.transport import CHECKS, TransportHarness, run_check

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class MemoryHarness(TransportHarness):
    """One shared :class:`MemoryTransport` plays every process's side."""

    not_applicable: ClassVar[Mapping[str, str]] = {
        "back_pressure": "MemoryTransport has no credit: a send never waits for receivers and "
        "payloads wait in the receivers' unbounded queues (the receiver engine bounds what it "
        "decodes); see dcr.adapters.transport.memory",
    }

    def __init__(self) -> None:
        self.transport = MemoryTransport()
        self.names: set[str] = set()

    async def sender(self, owner: str) -> Transport:
        return self.transport

    async def receiver(self, name: str) -> Transport:
        self.names.add(name)
        return self.transport

    async def controller(self) -> Transport:
        return self.transport

    async def vanish(self, name: str) -> None:
        self.transport.unsubscribe(name)

    async def settle(self, receivers: Collection[str]) -> None:
        return None

    def boundary_stats(self) -> TransportStats:
        return self.transport.stats()

    async def aclose(self) -> None:
        for name in self.names:
            self.transport.unsubscribe(name)
        await self.transport.aclose()


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_memory_transport_conformance(check: str) -> None:
    async with MemoryHarness() as harness:
        reason = await run_check(check, harness)
    assert reason is None or check in MemoryHarness.not_applicable


def test_memory_transport_is_registered() -> None:
    assert load("transport", "memory") is MemoryTransport
