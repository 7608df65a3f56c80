"""What keeps the model checker's searches fast: a bounded memo for the symmetry reductions,
and :func:`evolve`, a cheap :func:`dataclasses.replace` for the states they build millions of.

The memo holds what a reduction derives from one part of a state (a receiver's variables, the
payloads in flight, ...), per distinct part: a search meets few distinct parts and millions of
states built from them.  Parts are immutable and hash in C (tuples, frozensets, named tuples,
frozen dataclasses with a cached hash); each kind of part gets a tag of its own in the key,
since named tuples of different kinds may compare equal as tuples."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["clear", "evolve", "memo"]

_T = TypeVar("_T")

_MEMO: dict[Hashable, Any] = {}
_LIMIT = 1 << 18
"""Entries kept before the memo starts over (bounds its memory in a long search)."""

_INIT_FIELDS: dict[type, tuple[str, ...]] = {}


def memo(key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per distinct ``key`` (tag the key with what is derived)."""
    value = _MEMO.get(key)
    if value is None:
        if len(_MEMO) >= _LIMIT:
            _MEMO.clear()
        value = _MEMO[key] = make()
    return value


def clear() -> None:
    """Forget everything memoized (a test compares memoized results with fresh ones)."""
    _MEMO.clear()


def evolve(state: _T, **changes: Any) -> _T:
    """A copy of the dataclass ``state`` with ``changes``: :func:`dataclasses.replace` without
    its per-field checks (a subclass's own fields are kept too)."""
    cls = type(state)
    names = _INIT_FIELDS.get(cls)
    if names is None:
        names = _INIT_FIELDS[cls] = tuple(f.name for f in fields(cls) if f.init)  # type: ignore[arg-type]
    for name in names:
        if name not in changes:
            changes[name] = getattr(state, name)
    return cls(**changes)
