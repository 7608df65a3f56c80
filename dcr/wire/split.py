"""Rice-split coding: non-negative integers as entropy-friendly byte streams (format versions 2
and 3).

A word ``x`` with parameter ``k`` is split into its quotient ``q = x >> k`` and its remainder
``r = x & (2**k - 1)``.  The quotient goes into a *symbol* stream, capped at ``cap`` (255 for
gap symbols, one per byte; 15 for ULP value symbols, two per byte); a quotient ``>= cap`` is
written as the symbol ``cap`` plus an *escape* word holding the quotient.  The remainder goes
into ``k`` bits per word (:func:`pack_bits`: whole bytes as byte planes, the rest packed).
With ``k`` chosen so that ``q`` has a spread-out distribution and ``r`` is nearly uniform,
zstd's Huffman stage then codes the symbols close to their order-0 entropy and the remainders
cost ``k`` bits, with nothing but numpy here.

Gaps between changed positions are geometric; ULP deltas are small signed integers, zigzagged
(``0, -1, 1, -2, ...`` -> ``0, 1, 2, 3, ...``) before splitting.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dcr import native

__all__ = [
    "GAP_CAP",
    "VALUE_CAP",
    "gap_k",
    "pack_bits",
    "pack_nibbles",
    "remainder_bytes",
    "remainder_width",
    "split",
    "unpack_bits",
    "unpack_nibbles",
    "unzigzag",
    "value_k",
    "value_k_of",
    "zigzag",
]

GAP_CAP: Final = 255
"""Largest gap symbol; it marks an escape."""
VALUE_CAP: Final = 15
"""Largest ULP value symbol (a nibble); it marks an escape."""

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SAMPLE = 1 << 16


def remainder_width(k: int) -> int:
    """Bytes of the remainder word for parameter ``k``: 0, 1, 2, 4 or 8."""
    if k == 0:
        return 0
    for w in (1, 2, 4, 8):
        if k <= 8 * w:
            return w
    raise ValueError(f"Rice parameter {k} exceeds 64 bits")


def gap_k(count: int, first: int, last: int) -> int:
    """Rice parameter for ``count`` sorted positions from ``first`` to ``last`` (count >= 2).

    About an eighth of the mean gap: the quotient then spans tens of symbols (low Huffman
    redundancy) and the low bits are close to uniform.
    """
    mean = (last - first - (count - 1)) // (count - 1)
    return max(0, mean.bit_length() - 3)


def value_k(words: npt.NDArray[np.unsignedinteger[Any]]) -> int:
    """Rice parameter for zigzagged ULP deltas: the smallest ``k`` that keeps all but about
    1/256 of the quotients below :data:`VALUE_CAP` (estimated on an evenly strided sample)."""
    n = int(words.shape[0])
    if n == 0:
        return 0
    sample = words[:: max(1, n // _SAMPLE)]
    m = int(sample.shape[0])
    rank = min(m - 1, m - 1 - m // 256)
    t = int(np.partition(sample, rank)[rank])
    return 0 if t < VALUE_CAP else (t // VALUE_CAP).bit_length()


def value_k_of(values: npt.NDArray[np.unsignedinteger[Any]]) -> int:
    """:func:`value_k` of ``zigzag(values)``, zigzagging only the sample it looks at (in C
    when :mod:`dcr.native` has its kernels: a histogram instead of a partition)."""
    n = int(values.shape[0])
    step = max(1, n // _SAMPLE)
    kernels = native.kernels
    if kernels is not None and values.flags.c_contiguous:
        return int(kernels.value_k(values, step, VALUE_CAP))
    return value_k(zigzag(values[::step]))


def zigzag(values: npt.NDArray[np.unsignedinteger[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Two's-complement words (as unsigned) to zigzag order; same dtype, a new array."""
    w = values.dtype.itemsize
    s: npt.NDArray[np.signedinteger[Any]] = values.view(_SIGNED[w])
    out = np.left_shift(s, 1)
    out ^= s >> (8 * w - 1)
    result: npt.NDArray[np.unsignedinteger[Any]] = out.view(_UNSIGNED[w])
    return result


def unzigzag(words: npt.NDArray[np.unsignedinteger[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Inverse of :func:`zigzag`, in place on ``words``; returns ``words``."""
    low = (words & 1).view(_SIGNED[words.dtype.itemsize])
    np.negative(low, out=low)
    words >>= 1
    words ^= low.view(words.dtype)
    return words


def split(
    x: npt.NDArray[np.unsignedinteger[Any]], k: int, cap: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint64], npt.NDArray[np.unsignedinteger[Any]]]:
    """``(symbols, escapes, remainders)`` of the words ``x`` with parameter ``k``.

    Symbols are ``min(q, cap)`` as bytes; escapes are the quotients ``>= cap`` in order, as
    u64; remainders are the low ``k`` bits in words of :func:`remainder_width` bytes (an empty
    array for ``k == 0``).
    """
    if k:
        q = x >> x.dtype.type(k)
        rw = remainder_width(k)
        rem = (x & x.dtype.type((1 << k) - 1)).astype(_UNSIGNED[rw], copy=False)
    else:
        q = x
        rem = np.empty(0, dtype=np.uint8)
    big = q >= cap
    if bool(big.any()):
        escapes = q[big].astype(np.uint64)
        symbols = np.minimum(q, cap).astype(np.uint8)
    else:
        escapes = np.empty(0, dtype=np.uint64)
        symbols = q.astype(np.uint8)
    return symbols, escapes, rem


def pack_nibbles(symbols: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Pairs of symbols below 16 in one byte each, the first in the low nibble; an odd count
    is padded with a zero nibble."""
    n = int(symbols.shape[0])
    out = symbols[0::2].copy()
    high = symbols[1::2]
    out[: high.shape[0]] |= high << 4
    assert out.shape[0] == (n + 1) // 2
    return out


def unpack_nibbles(packed: npt.NDArray[np.uint8], n: int) -> npt.NDArray[np.uint8] | None:
    """``n`` symbols from :func:`pack_nibbles` output, or ``None`` if the padding nibble of an
    odd count is not zero."""
    out = np.empty(2 * packed.shape[0], dtype=np.uint8)
    np.bitwise_and(packed, 15, out=out[0::2])
    np.right_shift(packed, 4, out=out[1::2])
    if n % 2 and n and int(out[n]) != 0:
        return None
    return out[:n]


def remainder_bytes(n: int, k: int) -> int:
    """Bytes of :func:`pack_bits` output for ``n`` words of ``k`` bits."""
    return n * (k // 8) + (n * (k % 8) + 7) // 8


def pack_bits(words: npt.NDArray[np.unsignedinteger[Any]], k: int) -> npt.NDArray[np.uint8]:
    """The low ``k`` bits of each word: ``k // 8`` byte planes (bits 0-7 of every word, then
    bits 8-15, ...), then the remaining ``t = k % 8`` top bits of every word packed into bytes,
    least significant bit first, word after word (the last byte padded with zero bits)."""
    n = int(words.shape[0])
    planes, t = divmod(k, 8)
    out = np.empty(remainder_bytes(n, k), dtype=np.uint8)
    x = words.astype(np.uint64, copy=False)
    for b in range(planes):
        np.bitwise_and(x >> np.uint64(8 * b), 0xFF, out=out[b * n : (b + 1) * n], casting="unsafe")
    if t:
        top = (x >> np.uint64(8 * planes)) & np.uint64((1 << t) - 1)
        groups = (n + 7) // 8
        padded = np.zeros(8 * groups, dtype=np.uint64)
        padded[:n] = top
        lanes = padded.reshape(groups, 8)
        acc = lanes[:, 0].copy()
        for j in range(1, 8):
            acc |= lanes[:, j] << np.uint64(j * t)
        packed = acc.astype("<u8").view(np.uint8).reshape(groups, 8)[:, :t].reshape(-1)
        out[planes * n :] = packed[: out.shape[0] - planes * n]
    return out


def unpack_bits(stream: npt.NDArray[np.uint8], k: int, n: int) -> npt.NDArray[np.uint64] | None:
    """``n`` words of ``k`` bits from :func:`pack_bits` output (:func:`remainder_bytes`
    long) as u64; ``None`` if a padding bit is set."""
    planes, t = divmod(k, 8)
    assert stream.shape[0] == remainder_bytes(n, k)
    out = np.zeros(n, dtype=np.uint64)
    for b in range(planes):
        out |= stream[b * n : (b + 1) * n].astype(np.uint64) << np.uint64(8 * b)
    if t:
        groups = (n + 7) // 8
        raw = np.zeros((groups, 8), dtype=np.uint8)
        tail = np.zeros(groups * t, dtype=np.uint8)
        tail[: stream.shape[0] - planes * n] = stream[planes * n :]
        raw[:, :t] = tail.reshape(groups, t)
        acc = raw.view("<u8").reshape(groups).astype(np.uint64)
        mask = np.uint64((1 << t) - 1)
        lanes = np.empty((groups, 8), dtype=np.uint64)
        for j in range(8):
            np.bitwise_and(acc >> np.uint64(j * t), mask, out=lanes[:, j])
        flat = lanes.reshape(-1)
        if bool(flat[n:].any()):
            return None
        out |= flat[:n] << np.uint64(8 * planes)
    return out
