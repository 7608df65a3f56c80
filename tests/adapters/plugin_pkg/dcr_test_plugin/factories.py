"""Factories a fleet file names directly as ``"dcr_test_plugin.factories:<name>"``."""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_CALLABLE", "make_trainer"]

NOT_CALLABLE = 42
"""Something that is neither a class nor a function."""


def make_trainer(**options: Any) -> dict[str, Any]:
    """A stand-in trainer: what it was built with."""
    return {"trainer": "echo", **options}
