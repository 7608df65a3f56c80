"""The in-memory control channel runs the control-channel conformance suite."""

from __future__ import annotations

from collections.abc import Collection

from dcr.adapters.control import MemoryControl
from dcr.adapters.control.base import CoordinatorLink, EndpointLink
from dcr.adapters.registry import load
from dcr.testing.control import ControlHarness, ControlTests


class MemoryHarness(ControlHarness):
    """One shared :class:`MemoryControl` plays every process's side."""

    def __init__(self) -> None:
        self.control = MemoryControl()
        self.links: list[EndpointLink] = []
        self._coordinator: CoordinatorLink | None = None

    async def coordinator(self) -> CoordinatorLink:
        if self._coordinator is None:
            self._coordinator = await self.control.coordinator()
        return self._coordinator

    async def endpoint(self, name: str) -> EndpointLink:
        link = await self.control.endpoint(name)
        self.links.append(link)
        return link

    def dropped_pending(self) -> int:
        return self.control.dropped_pending

    async def settle(
        self, *, connected: Collection[str] = (), disconnected: Collection[str] = ()
    ) -> None:
        return None

    async def aclose(self) -> None:
        for link in self.links:
            await link.aclose()
        if self._coordinator is not None:
            await self._coordinator.aclose()
        await self.control.aclose()


class TestMemoryControl(ControlTests):
    def make_harness(self) -> ControlHarness:
        return MemoryHarness()


def test_memory_control_is_registered() -> None:
    assert load("control", "memory") is MemoryControl
