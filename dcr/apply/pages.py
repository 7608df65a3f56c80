"""Huge pages for resident weights in host memory (Linux).

A sparse apply touches a few bytes in many pages of the resident weights: at 1% uniformly
scattered bf16 changes, every 4 KiB page of every tensor is visited about twenty times in
ascending order, and with 4 KiB pages each visit to a new page is a TLB miss (costlier still
in a virtual machine, where a miss walks two page tables).  Backed by 2 MiB pages the same
apply took about 12% less time where measured (docs/benchmarks.md, ``dcr bench apply`` at
1%).  A dense load, which streams, barely notices.

:func:`advise_huge_pages` asks the kernel to back the interior 2 MiB-aligned ranges of the
given CPU tensors with transparent huge pages: ``madvise(MADV_HUGEPAGE)`` for pages faulted
later, then ``madvise(MADV_COLLAPSE)`` (Linux 6.1+) to collapse the pages already present,
synchronously (it copies them: about 2 s per GB where measured).  Contents and addresses do
not change, so nothing the serving runtime holds is invalidated.  Where the kernel, its
settings or the memory (file-backed, locked, ...) refuse, the tensors stay as they were: the
advice is best-effort and never an error.  Receivers apply it at prewarm to their CPU
storages unless ``ApplyConfig(huge_pages=False)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["HUGE_PAGE", "HugePages", "advise_huge_pages"]

HUGE_PAGE = 2 << 20
"""The transparent huge page size on x86-64 and most arm64 kernels."""

_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


@dataclass(frozen=True, slots=True)
class HugePages:
    """What :func:`advise_huge_pages` did: bytes advised and bytes the kernel collapsed."""

    advised: int = 0
    collapsed: int = 0


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lambda start, size, advice: int(fn(start, size, advice))


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned interiors of the tensors' CPU storages, each storage once."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        if ptr == 0 or ptr in seen:
            continue
        seen.add(ptr)
        start = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        end = (ptr + nbytes) & ~(HUGE_PAGE - 1)
        if end > start:
            out.append((start, end - start))
    return out


def advise_huge_pages(tensors: Iterable[torch.Tensor], *, collapse: bool = True) -> HugePages:
    """Back the tensors' CPU storages with transparent huge pages where the kernel allows.

    Best-effort: returns the bytes advised and collapsed (both 0 off Linux, or where
    transparent huge pages are disabled); never raises for a refusal.
    ``DCR_HUGE_PAGES=0`` in the environment disables it.
    """
    if os.environ.get("DCR_HUGE_PAGES", "1") == "0":
        return HugePages()
    madvise = _madvise()
    if madvise is None:
        return HugePages()
    advised = collapsed = 0
    for start, size in _ranges(tensors):
        if madvise(start, size, _MADV_HUGEPAGE) != 0:
            continue  # THP disabled ("never") or memory that cannot take it
        advised += size
        if collapse and madvise(start, size, _MADV_COLLAPSE) == 0:
            collapsed += size
    return HugePages(advised=advised, collapsed=collapsed)
