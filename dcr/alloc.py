"""Allocator settings for the processes that run dcr's data plane.

Every refit decodes tens to hundreds of megabytes of entry arrays on each receiver and
gathers as much on each owner, and frees them again.  glibc's malloc returns such blocks to
the operating system (blocks above its mmap threshold are unmapped on free, the heap top is
trimmed), so the next refit touches fresh pages and pays a page fault per 4 KiB: measured at
about a fifth of a receiver's CPU time in a refit (``dcr bench refit``, 3% change).
:func:`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold to 2 GiB, so freed blocks are reused by the next refit instead; the process keeps
its peak heap (RSS does not shrink after a refit).

dcr's role processes (``dcr owner``, ``dcr receiver``, ``dcr relay``, ``dcr coordinator``)
and the receivers inside vLLM workers call it when they start.  ``DCR_MALLOC_TUNING=0`` in
the environment leaves the allocator as it is, and so do glibc's own settings there
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or
``glibc.malloc.*`` in ``GLIBC_TUNABLES``); on other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["keep_freed_memory"]

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's largest mmap threshold on 64-bit systems; larger blocks are always mapped."""
TRIM_THRESHOLD = (1 << 31) - 1

_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse; returns whether it was applied.

    Idempotent; a no-op (``False``) off glibc, with ``DCR_MALLOC_TUNING=0`` or where the
    environment sets glibc's malloc parameters itself.
    """
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _configured_by_environment() -> bool:
    env = os.environ
    return any(key in env for key in _MALLOC_VARIABLES) or "glibc.malloc." in env.get(
        "GLIBC_TUNABLES", ""
    )


def _apply() -> bool:
    if os.environ.get("DCR_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if _configured_by_environment():
        return False  # the operator chose the allocator's settings: keep them
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False  # not glibc: its mallopt does not take these parameters
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
