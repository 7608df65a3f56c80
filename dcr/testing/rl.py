"""Helpers of the ``dcr rl`` tests: the steps of a run whose refit was reported, and those
during which nothing was killed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["calm_refits", "reported_refits"]


def reported_refits(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``steps`` (``dcr rl --json``) whose refit was reported.  A row without a
    report must be a step the trainer replayed: it died after the version committed and
    before it learned of the commit (at most one per trainer kill)."""
    missing = [r for r in steps if r["payload_bytes"] is None]
    assert all(r["replayed"] and r["refit_s"] is None for r in missing), missing
    return [r for r in steps if r["payload_bytes"] is not None]


def calm_refits(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The reported refits of a ``dcr rl --json`` result during which nothing was killed: a
    step whose attempt was killed also counts the bytes its retry sent (the two can exceed a
    dense checkpoint), the others are one attempt each."""
    faulted = {k["step"] for k in result["killed"]}
    return [r for r in reported_refits(result["steps"]) if r["step"] not in faulted]
