"""The in-memory transport runs the transport conformance suite."""

from __future__ import annotations

from dcr.adapters.registry import load
from dcr.adapters.transport import MemoryTransport
from dcr.adapters.transport.base import Transport
from dcr.testing.transport import TransportTests


class TestMemoryTransport(TransportTests):
    """One shared :class:`MemoryTransport` plays every process's side."""

    shared = True
    # MemoryTransport has no credit: a send never waits for receivers and payloads wait in
    # the receivers' unbounded queues (the receiver engine bounds what it decodes); see
    # dcr.adapters.transport.memory.
    credit = False

    async def make_transport(self) -> Transport:
        return MemoryTransport()


def test_memory_transport_is_registered() -> None:
    assert load("transport", "memory") is MemoryTransport
