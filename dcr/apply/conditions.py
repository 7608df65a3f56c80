"""Loader conditions: what every loader call of an apply must show before its writes may land.

Each payload re-proves, for every name it touches, that the native loader still makes the
writes recorded at prewarm (paper App. A.2): the call may not write into scratch unless prewarm
saw it do so, must route every write through the dispatch hook and report as at prewarm, and
its writes must repeat the prewarm record (count, destination, source, value).  XOR and ULP
entries further need copies that read scratch without a dtype change and do not share
destination bytes.  A broken condition raises :class:`LoaderConditionViolated` (prewarm's own
checks raise :class:`LoaderPathUnsupported`) before any write lands.
"""

from __future__ import annotations

import torch

from dcr.apply.admission import Group
from dcr.apply.call import Fail, LoaderCall, run_loader
from dcr.apply.hook import SourceKind
from dcr.apply.loader import Loader
from dcr.apply.paths import LoaderPath, matches
from dcr.apply.storage import StorageGuard
from dcr.apply.writes import copies_overlap
from dcr.errors import DcrError, LoaderConditionViolated, LoaderPathUnsupported

__all__ = [
    "call_checked",
    "check_pattern",
    "repeats_prewarm",
    "unsupported",
    "violation",
    "witness",
]


def unsupported(name: str | None) -> Fail:
    """Failures at prewarm (and after a dense load): :class:`LoaderPathUnsupported`."""

    def fail(message: str, check: str) -> DcrError:
        return LoaderPathUnsupported(message, tensor=name, check=check)

    return fail


def violation(attempt: int | None, name: str | None) -> Fail:
    """Failures while applying: :class:`LoaderConditionViolated`."""

    def fail(message: str, check: str) -> DcrError:
        return LoaderConditionViolated(message, attempt=attempt, tensor=name, check=check)

    return fail


def call_checked(
    loader: Loader,
    guard: StorageGuard,
    scratch_ptr: int,
    path: LoaderPath,
    view: torch.Tensor,
    fail: Fail,
) -> LoaderCall:
    """One loader call on ``path``'s name (:func:`run_loader`), checked for scratch writes,
    writes that bypassed the hook and a report that differs from prewarm's."""
    call = run_loader(loader, guard, scratch_ptr, path.name, view, fail, path.storages)
    if call.scratch_writes and not path.scratch_mutated:
        raise fail(
            f"the loader wrote into scratch ({', '.join(call.scratch_writes[:3])}); "
            "it must leave the values it is given unchanged",
            "scratch-mutated",
        )
    if call.reported and not call.copies:
        raise fail(
            "the loader reports a load but no copy reached the dispatch hook: a write "
            "bypassed the hook and may already have landed; repair by an overwrite retry "
            "or a dense refit",
            "bypass",
        )
    if call.reported != path.reported:
        raise fail(
            f"the loader reported {call.reported} where prewarm saw {path.reported}",
            "report",
        )
    return call


def check_pattern(path: LoaderPath, call: LoaderCall, fail: Fail) -> None:
    if not repeats_prewarm(path, call):
        raise fail(
            f"the loader made {len(call.writes)} writes that differ from the "
            f"{len(path.writes)} recorded at prewarm (count, destination, source or value)",
            "pattern",
        )


def witness(group: Group, call: LoaderCall, fail: Fail, *, repeats: bool = False) -> LoaderCall:
    """Check that a loader call made the writes the group's encoding may go through
    (``repeats``: the caller found that it repeats the prewarm record)."""
    path = group.path
    if group.encoding.relative:
        what = group.encoding.name
        for copy in call.copies:
            if copy.src_geometry.dtype != copy.dst_geometry.dtype:
                raise fail(
                    f"the copy into {copy.storage.label!r} changes dtype "
                    f"({copy.src_geometry.dtype} -> {copy.dst_geometry.dtype}) on an "
                    f"{what} path",
                    "xor-dtype",
                )
            if copy.source is not SourceKind.SCRATCH:
                raise fail(
                    f"the copy into {copy.storage.label!r} does not read scratch storage "
                    f"on an {what} path",
                    "xor-source",
                )
    if not repeats and not repeats_prewarm(path, call):
        if group.encoding.relative and copies_overlap(call.copies):
            raise fail(
                f"two {group.encoding.name} writes of the item share destination bytes",
                "xor-overlap",
            )
        check_pattern(path, call, fail)
    return call


def repeats_prewarm(path: LoaderPath, call: LoaderCall) -> bool:
    """Whether the call made exactly the writes recorded at prewarm.

    Constant fills must recur too but are never executed: they rewrite a constant the dense
    load already wrote, and prewarm proved they never overlap a copy.
    """
    return len(call.writes) == len(path.writes) and all(
        matches(r, w) for r, w in zip(path.writes, call.writes, strict=True)
    )
