"""One native-loader call on one canonical tensor, under the dispatch hook."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from dcr.apply.hook import InterceptedCopy, InterceptedWrite, WriteInterceptor
from dcr.apply.loader import Loader
from dcr.apply.storage import StorageGuard
from dcr.errors import DcrError

__all__ = ["Fail", "LoaderCall", "run_loader"]

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
