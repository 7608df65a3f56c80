"""What a receiver reports: prewarm (:class:`PrewarmReport`) and applied payloads
(:class:`ApplyReport`, one :class:`ItemReport` per applied group)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dcr.apply.paths import PathKind
from dcr.tensors.records import Encoding

__all__ = ["ApplyReport", "ItemReport", "PrewarmReport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrewarmReport:
    """What prewarm found: path kinds per name, scratch size, loader calls and time;
    ``huge_page_bytes``: resident bytes now backed by huge pages (``ApplyConfig.huge_pages``)."""

    names: int
    preserving: int
    transforming: int
    skipped: int
    xor_allowed: int
    scratch_bytes: int
    loader_calls: int
    seconds: float
    huge_page_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemReport:
    """One applied group: a name's items of one encoding in one call, merged.

    ``entries`` counts the group's entries and ``merged`` the items they came in.
    ``written`` counts destination elements (an entry can land 0 times -- another rank's rows
    -- or several times -- a replicated copy); ``checked`` counts post-apply-checked positions.
    ``dense`` says whether some copy was reproduced over its whole view (the placeholder path,
    or NaN/subnormal values through a cast) instead of at the entries only.
    """

    name: str
    encoding: Encoding
    kind: PathKind
    entries: int
    merged: int
    written: int
    copies: int
    bytes_written: int
    loader_calls: int
    dense: bool
    checked: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyReport:
    """Totals over a sequence of applied items, plus the per-item reports."""

    items: tuple[ItemReport, ...]
    entries: int
    written: int
    copies: int
    bytes_written: int
    loader_calls: int
    checked: int
    seconds: float

    @classmethod
    def of(cls, items: Iterable[ItemReport], seconds: float) -> ApplyReport:
        done = tuple(items)
        return cls(
            items=done,
            entries=sum(r.entries for r in done),
            written=sum(r.written for r in done),
            copies=sum(r.copies for r in done),
            bytes_written=sum(r.bytes_written for r in done),
            loader_calls=sum(r.loader_calls for r in done),
            checked=sum(r.checked for r in done),
            seconds=seconds,
        )
