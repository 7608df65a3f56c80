"""A bounded memo for the searches' symmetry reductions: what they derive from one part of a
state (a receiver's variables, the payloads in flight, ...), per distinct part.  A search
meets few distinct parts and millions of states built from them; parts are immutable and
hash in C (tuples, frozensets, named tuples, frozen dataclasses with a cached hash)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["memo"]

_MEMO: dict[Hashable, Any] = {}
_LIMIT = 1 << 18
"""Entries kept before the memo starts over (bounds its memory in a long search)."""


def memo(key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per distinct ``key`` (tag the key with what is derived)."""
    value = _MEMO.get(key)
    if value is None:
        if len(_MEMO) >= _LIMIT:
            _MEMO.clear()
        value = _MEMO[key] = make()
    return value
