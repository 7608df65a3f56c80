"""What the adapter conformance suites share: running one named check on a harness."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

__all__ = ["run_named_check"]


async def run_named_check(
    checks: Mapping[str, Callable[[Any], Awaitable[None]]], name: str, harness: Any
) -> str | None:
    """Run check ``name`` on ``harness`` (which names the checks it cannot meet by design in
    ``not_applicable`` and bounds each check by ``timeout_s``).

    Returns ``None`` when the check ran and passed, or the harness's stated reason when the
    check does not apply to the adapter (a reason must be given).
    """
    reason: str | None = harness.not_applicable.get(name)
    if reason is not None:
        if not reason.strip():
            raise AssertionError(f"{name} is marked not applicable without a reason")
        return reason
    with anyio.fail_after(harness.timeout_s):
        await checks[name](harness)
    return None
