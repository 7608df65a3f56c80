"""Byte planes: little-endian words stored column-wise, byte 0 of every word first.

XOR masks of small updates, and gaps between sparse changes, have mostly-zero high bytes.
Storing all byte-0s, then all byte-1s, ... puts those zeros next to each other, which zstd
compresses far better than interleaved words (measured in ``docs/wire-format.md``).  A group of
``n`` words of width ``w`` is an ``n x w`` byte matrix: the plain layout stores it row-major,
the byte-plane layout column-major.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["join_planes", "split_planes", "word_dtype"]

_WORD_DTYPES: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


def word_dtype(width: int) -> np.dtype[np.unsignedinteger[Any]]:
    """Little-endian unsigned dtype of ``width`` bytes."""
    return _WORD_DTYPES[width]


def split_planes(words: npt.NDArray[np.unsignedinteger[Any]], out: npt.NDArray[np.uint8]) -> None:
    """Write ``words`` (1-D, any byte order) into ``out``, a ``(width, n)`` byte matrix view."""
    width = words.dtype.itemsize
    le = words.astype(word_dtype(width), copy=False)
    out[...] = le.view(np.uint8).reshape(-1, width).T


def join_planes(
    planes: npt.NDArray[np.uint8], dtype: np.dtype[np.unsignedinteger[Any]]
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """Words of native ``dtype`` from a ``(width, n)`` byte matrix; the result owns its memory."""
    width, n = planes.shape
    rows = np.empty((n, width), dtype=np.uint8)
    rows[...] = planes.T
    return rows.view(word_dtype(width)).reshape(n).astype(dtype, copy=False)
