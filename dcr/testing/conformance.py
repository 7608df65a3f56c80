"""What the adapter conformance suites share: the pytest base of their test classes.

The suites -- :class:`~dcr.testing.transport.TransportTests`,
:class:`~dcr.testing.control.ControlTests`, :class:`~dcr.testing.commit_store.CommitStoreTests`
and :class:`~dcr.testing.loader.LoaderTests` -- are base classes of pytest test classes: an
adapter's test module subclasses one as ``class TestMyAdapter(TransportTests)``, provides the
hook that builds its adapter, and pytest collects every ``test_*`` method for it (the bases'
own names do not start with ``Test``, so they are never collected themselves).  The async
suites run on anyio's pytest plugin, which comes with anyio (a dcr dependency), on asyncio;
no other pytest plugin is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

import anyio
import pytest

__all__ = ["AsyncSuite", "until"]


class AsyncSuite:
    """Base of the async suites: every test runs on anyio's pytest plugin (asyncio), and a
    check is bounded by :attr:`timeout_s` (a subclass raises it for slow adapters)."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]
    timeout_s: ClassVar[float] = 20.0
    """Upper bound for one check."""

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"


async def until(
    predicate: Callable[[], bool], timeout_s: float, what: str, *, poll_s: float = 0.01
) -> None:
    """Poll ``predicate`` every ``poll_s`` for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await anyio.sleep(poll_s)
