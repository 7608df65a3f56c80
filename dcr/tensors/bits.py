"""Stored-bit views and change detection (paper §4.1, App. A.1 "Change detection").

Changes are found by comparing stored bit patterns, never float values: ``+0.0``/``-0.0`` and
NaN payloads differ in bits and must produce records.  Every dtype is compared through the
unsigned integer type of the same width.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr import native
from dcr.errors import ConfigError
from dcr.tensors.ordered import ulp_delta

__all__ = [
    "DTYPE_CODES",
    "DTYPE_FROM_CODE",
    "bits",
    "bits_dtype",
    "changed_indices",
    "changed_values",
    "changed_words",
    "copy_at",
    "dtype_name",
    "numpy_bits_dtype",
]

# Wire codes of the dtypes dcr carries.  Codes are part of the payload format: never renumber.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
    torch.float8_e4m3fn: 11,
    torch.float8_e5m2: 12,
}
DTYPE_FROM_CODE: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}

_TORCH_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_BITS: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

# Elements compared per block: bounds the boolean temporary to 1 MiB, reused per thread (a
# fresh temporary per block costs page faults that halve the comparison rate).
_BLOCK = 1 << 20
_scratch = threading.local()

UInt = npt.NDArray[np.unsignedinteger[Any]]
Index = npt.NDArray[np.int64]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _width(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ConfigError(f"dtype {dtype_name(dtype)} is not supported", check="dtype")
    return dtype.itemsize


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch integer dtype of the same width (bool and 1-byte types use ``uint8``)."""
    return _TORCH_BITS[_width(dtype)]


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two integer bit views differ (a quick ``any`` first: counting
    takes a full reduction into int64, five times as long, and the answer is mostly 0)."""
    ne = a != b
    return int(ne.sum()) if bool(ne.any()) else 0


def numpy_bits_dtype(dtype: torch.dtype) -> type[np.unsignedinteger[Any]]:
    """The numpy unsigned integer type of the same width as ``dtype``."""
    return _NUMPY_BITS[_width(dtype)]


def bits(t: torch.Tensor) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Zero-copy unsigned-integer numpy view of a CPU tensor's stored bits (same shape)."""
    t = t.detach()
    if t.device.type != "cpu":
        raise ConfigError(f"bits() needs a CPU tensor, got {t.device}", check="device")
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    view = t.view(bits_dtype(t.dtype)).numpy()
    return view.view(numpy_bits_dtype(t.dtype))


def _mask(n: int) -> npt.NDArray[np.bool_]:
    """This thread's boolean scratch: at least ``n`` flags plus room for :func:`_flatnonzero`."""
    need = n + n // 8 + 64
    buf: npt.NDArray[np.bool_] | None = getattr(_scratch, "mask", None)
    if buf is None or buf.shape[0] < need:
        buf = _scratch.mask = np.empty(max(need, _BLOCK + _BLOCK // 8 + 64), dtype=np.bool_)
    return buf


def _flatnonzero(buf: npt.NDArray[np.bool_], n: int) -> Index:
    """``np.flatnonzero(buf[:n])``, fast at every density (``buf`` from :func:`_mask`).

    numpy scans flags branch-free above 10 % density and with a branchy skip below it, which
    mispredicts on fresh data at a few percent -- up to 3x slower than branch-free, and that
    is the density of changed words at usual change rates.  Between 1 % and 10 % (below 1 %
    the skip wins) the flags are padded with ``True`` past ``n`` up to just over 10 %, and
    the padding's positions are cut off.
    """
    mask = buf[:n]
    count = int(np.count_nonzero(mask))
    if count * 100 <= n or count * 10 > n:
        return np.flatnonzero(mask)
    pad = (n - 10 * count) // 9 + 16
    buf[n : n + pad] = True
    return np.flatnonzero(buf[: n + pad])[:count]


def _plain(a: UInt, b: UInt, new_values: bool) -> tuple[Index, UInt, UInt | None]:
    n = a.shape[0]
    buf = _mask(n)
    np.not_equal(a, b, out=buf[:n])
    pos = _flatnonzero(buf, n)
    nv = a.take(pos, mode="clip")
    xv = nv ^ b.take(pos, mode="clip")
    return pos, xv, nv if new_values else None


def _words(a: UInt, b: UInt, new_values: bool) -> tuple[Index, UInt, UInt | None]:
    """:func:`changed_words` on 8-byte-aligned arrays whose length is a multiple of 8 bytes.

    Compares 64-bit words (several elements at once, so the position scan touches a few
    times fewer flags), then splits the changed words back into elements.  The lanes of a
    64-bit view are the elements in memory order, whatever the byte order.
    """
    k = 8 // a.itemsize
    shift = k.bit_length() - 1
    a64, b64 = a.view(np.uint64), b.view(np.uint64)
    n = a64.shape[0]
    # XOR into a per-thread scratch that stays in the core's cache: the flags and the gather
    # of changed masks then read it there instead of both arrays again.
    scratch: npt.NDArray[np.uint64] | None = getattr(_scratch, "words", None)
    if scratch is None or scratch.shape[0] < n:
        scratch = _scratch.words = np.empty(max(n, _BLOCK // 4), dtype=np.uint64)
    x = scratch[:n]
    np.bitwise_xor(a64, b64, out=x)
    buf = _mask(n)
    np.not_equal(x, 0, out=buf[:n])
    word = _flatnonzero(buf, n)
    # ``take`` with ``mode="clip"`` skips the bounds checks of fancy indexing (the indices
    # come from the scan, so they are in range).
    lanes = x.take(word, mode="clip").view(a.dtype)
    hit = np.flatnonzero(lanes != 0)
    pos = word.take(hit >> shift, mode="clip")
    pos <<= shift
    pos |= hit & (k - 1)
    nv = None
    if new_values:
        nv = a64.take(word, mode="clip").view(a.dtype).take(hit, mode="clip")
    return pos, lanes.take(hit, mode="clip"), nv


def _check_views(new: UInt, old: UInt, what: str) -> None:
    if new.ndim != 1 or new.shape != old.shape or new.dtype != old.dtype or new.dtype.kind != "u":
        raise ConfigError(
            f"{what} needs two 1-D unsigned bit views of one shape, got "
            f"{new.dtype}{list(new.shape)} and {old.dtype}{list(old.shape)}",
            check="shape",
        )


_SLACK = 64
"""Entries the C scan may write past the changed count (whole-vector stores)."""


def _scan_buffers(n: int, dtype: np.dtype[Any]) -> tuple[npt.NDArray[np.uint32], UInt, UInt]:
    """This thread's output buffers of the C scan, for ``n`` entries (reused)."""
    key = f"scan{dtype.itemsize}"
    bufs: tuple[npt.NDArray[np.uint32], UInt, UInt] | None = getattr(_scratch, key, None)
    if bufs is None or bufs[0].shape[0] < n + _SLACK:
        size = max(n, _BLOCK) + _SLACK
        bufs = (np.empty(size, np.uint32), np.empty(size, dtype), np.empty(size, dtype))
        setattr(_scratch, key, bufs)
    return bufs


def changed_values(
    new: UInt, old: UInt, kind: str, *, offset: int = 0
) -> tuple[Index, UInt, UInt | None]:
    """Where two 1-D bit views differ, and what construction sends there, in one pass.

    ``kind`` is ``"xor"`` (``new ^ old``), ``"ulp"`` (the ULP delta,
    :func:`~dcr.tensors.ordered.ulp_delta`), ``"new"`` (the new words) or ``"xor+new"`` (both:
    the second array holds the new words).  Returns sorted int64 positions, the values and the
    second array or ``None``; the arrays are new and exactly as long as the changed set.
    ``offset`` is added to every position.  Runs in C when :mod:`dcr.native` has its kernels
    (one pass: detect, gather, encode), else through :func:`changed_words`; blocks of more
    than ``2**32 - 1`` elements go through :func:`changed_words` too.
    """
    _check_views(new, old, "changed_values")
    if kind not in native.SCAN_KIND:
        raise ConfigError(f"unknown scan kind {kind!r}", check="kind")
    k = native.kernels
    if k is None or new.shape[0] >= 1 << 32:
        pos, xv, nv = changed_words(new, old, new_values=kind != "xor")
        if offset:
            pos += offset
        if kind == "xor":
            return pos, xv, None
        assert nv is not None
        if kind == "new":
            return pos, nv, None
        if kind == "ulp":
            return pos, ulp_delta(nv, nv ^ xv), None
        return pos, xv, nv
    pos_buf, out, out2 = _scan_buffers(new.shape[0], new.dtype)
    count = k.scan(new, old, native.SCAN_KIND[kind], pos_buf, out, out2)
    second = out2[:count].copy() if kind == "xor+new" else None
    pos = np.add(pos_buf[:count], np.int64(offset), dtype=np.int64)
    return pos, out[:count].copy(), second


def copy_at(dst: UInt, src: UInt, positions: Index, shift: int = 0) -> None:
    """``dst[p - shift] = src[p - shift]`` for every position: an owner's baseline update.

    ``dst`` and ``src`` are 1-D bit views of one length.  In C when :mod:`dcr.native` has its
    kernels (one pass, the GIL released), else by numpy fancy indexing; a position outside
    the views raises ``ValueError`` before anything is written.
    """
    k = native.kernels
    if k is not None:
        k.copy_at(dst, src, positions, shift)
        return
    idx = positions - shift if shift else positions
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= dst.shape[0]):
        raise ValueError("a position lies outside the views")
    dst[idx] = src[idx]


def changed_words(
    new: UInt, old: UInt, *, new_values: bool = False
) -> tuple[Index, UInt, UInt | None]:
    """Where two 1-D bit views differ, with the XOR masks (and new words) gathered there.

    Returns ``(positions, new ^ old at them, new at them or None)``; positions are sorted
    int64 offsets into the arrays.  Detection and the gather of changed values are one pass
    over the data: the gathers read what the comparison just brought into cache.  Call it
    on blocks of about a million elements; numpy releases the GIL, so blocks run in
    parallel threads.
    """
    _check_views(new, old, "changed_words")
    n = new.shape[0]
    width = new.itemsize
    if width >= 8 or n < 64:
        return _plain(new, old, new_values)
    addr, addr_old = new.ctypes.data, old.ctypes.data
    if addr % width or (addr - addr_old) % 8:
        return _plain(new, old, new_values)
    head = (-addr % 8) // width
    k = 8 // width
    stop = head + (n - head) // k * k
    pos, xv, nv = _words(new[head:stop], old[head:stop], new_values)
    if head:
        pos += head
    if head or stop < n:
        parts = [(pos, xv, nv)]
        for lo, hi in ((0, head), (stop, n)):
            if hi > lo:
                p, x, v = _plain(new[lo:hi], old[lo:hi], new_values)
                if p.size:
                    p += lo
                    parts.insert(0 if lo == 0 else len(parts), (p, x, v))
        if len(parts) > 1:
            pos = np.concatenate([p[0] for p in parts])
            xv = np.concatenate([p[1] for p in parts])
            if new_values:
                nv = np.concatenate([p[2] for p in parts if p[2] is not None])
    return pos, xv, nv


def changed_indices(
    new: npt.NDArray[np.generic], old: npt.NDArray[np.generic], *, block: int = _BLOCK
) -> npt.NDArray[np.int64]:
    """Flat C-order indices where the stored bits of ``new`` and ``old`` differ.

    Both arrays must be unsigned bit views of one shape (see :func:`bits`).  The comparison runs
    in blocks (:func:`changed_words`) so no full-size temporary is created; numpy releases the
    GIL, so several calls run in parallel threads.
    """
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ConfigError(
            f"cannot compare {new.dtype}{list(new.shape)} with {old.dtype}{list(old.shape)}",
            check="shape",
        )
    if new.dtype.kind != "u":
        raise ConfigError(f"changed_indices needs unsigned bit views, got {new.dtype}")
    a: UInt = new.reshape(-1)  # type: ignore[assignment]
    b: UInt = old.reshape(-1)  # type: ignore[assignment]
    n = a.shape[0]
    parts = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        hit = changed_values(a[start:stop], b[start:stop], "xor")[0]
        if hit.size:
            if start:
                hit += start
            parts.append(hit)
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
