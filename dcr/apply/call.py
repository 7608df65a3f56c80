"""One native-loader call on one canonical tensor, under the dispatch hook."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from dcr.apply.hook import InterceptedCopy, InterceptedWrite, WriteInterceptor
from dcr.apply.loader import Loader
from dcr.apply.storage import StorageGuard
from dcr.errors import DcrError

__all__ = ["Fail", "LoaderCall", "run_loader", "run_loader_batch"]

Fail = Callable[[str, str], DcrError]
"""Builds the error for a failed check: ``fail(message, check)``."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LoaderCall:
    """What one loader call did: its report and its withheld writes into resident storage."""

    reported: bool | None
    writes: tuple[InterceptedWrite, ...]
    scratch_writes: tuple[str, ...]

    @property
    def copies(self) -> tuple[InterceptedCopy, ...]:
        return tuple(w for w in self.writes if isinstance(w, InterceptedCopy))


def run_loader(
    loader: Loader,
    guard: StorageGuard,
    scratch_ptr: int,
    name: str,
    view: torch.Tensor,
    fail: Fail,
    labels: Collection[str] = (),
) -> LoaderCall:
    """Run ``loader.load_weights([(name, view)])`` with every resident write withheld.

    Afterwards the storages in ``labels`` and every storage the call wrote must not have moved
    (see :meth:`StorageGuard.check`).  A loader exception becomes ``fail(..., "loader-error")``;
    nothing was written into resident storage.
    """
    hook = WriteInterceptor(guard.protected, scratch_ptr, fail)
    error: BaseException | None = None
    result: set[str] | None = None
    try:
        with torch.no_grad(), hook:
            result = loader.load_weights([(name, view)])
    except DcrError as exc:
        error = exc
    except Exception as exc:
        error = fail(f"the native loader raised {type(exc).__name__}: {exc}", "loader-error")
        error.__cause__ = exc
    guard.check(fail, set(labels) | {w.storage.label for w in hook.writes})
    if hook.failure is not None:
        raise hook.failure
    if error is not None:
        raise error
    return LoaderCall(
        reported=None if result is None else bool(result),
        writes=tuple(hook.writes),
        scratch_writes=tuple(hook.scratch_writes),
    )


def run_loader_batch(
    loader: Loader,
    guard: StorageGuard,
    scratch_ptr: int,
    pairs: Sequence[tuple[str, torch.Tensor]],
    fail: Fail,
    labels: Collection[str] = (),
) -> list[LoaderCall] | None:
    """One ``loader.load_weights`` call over several names, every resident write withheld.

    The loader is handed a generator; each write is attributed to the name most recently
    drawn from it, which is right for loaders that load each tensor before they draw the next
    (vLLM's ``load_weights``, ``load_state_dict``-style loops).  Returns one
    :class:`LoaderCall` per name (``reported`` is the whole call's report), or ``None`` when
    the call cannot be split: it raised, the hook refused a write, the loader wrote into
    scratch or did not draw every name.  A loader that draws ahead attributes writes to the
    wrong names; the caller checks every name's writes against its prewarm record and calls
    the loader per name where they differ.  A moved storage raises as in :func:`run_loader`.
    """
    hook = WriteInterceptor(guard.protected, scratch_ptr, fail)
    marks: list[int] = []

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        for pair in pairs:
            marks.append(len(hook.writes))
            yield pair

    result: set[str] | None = None
    failed = False
    try:
        with torch.no_grad(), hook:
            result = loader.load_weights(feed())
    except Exception:  # the per-name calls report it, with the name at fault
        failed = True
    guard.check(fail, set(labels) | {w.storage.label for w in hook.writes})
    if failed or hook.failure is not None or hook.scratch_writes or len(marks) != len(pairs):
        return None
    reported = None if result is None else bool(result)
    return [
        LoaderCall(reported=reported, writes=tuple(hook.writes[a:b]), scratch_writes=())
        for a, b in pairwise([*marks, len(hook.writes)])
    ]
