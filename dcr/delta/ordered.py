"""Order-preserving bit patterns and ULP deltas (the ``ULP`` encoding).

A small update moves a float by a few units in the last place, yet its XOR mask can flip many
bits (a carry through the mantissa, a sign change near zero).  The *ordered* pattern of a
stored word maps the float order onto the unsigned integer order: non-negative patterns get
the sign bit set, negative patterns are inverted.  The map is a bijection of all ``2**w``
patterns of a ``w``-bit word -- ``+0``/``-0``, subnormals, infinities and every NaN payload
included -- so the ULP delta ``(ordered(new) - ordered(old)) mod 2**w`` always exists and
``unordered((ordered(old) + delta) mod 2**w)`` gives back exactly ``new``.

Like an XOR mask, a ULP delta is relative to the base bits: it is applied at most once, only
on loader paths that preserve stored bits.  Its values are small signed integers (two's
complement in the word), which compress better than XOR masks.

Works on numpy unsigned words (``uint8`` .. ``uint64``) and on torch's same-width signed
integer views (``uint8``, ``int16``, ``int32``, ``int64``); both wrap modulo ``2**w``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["ULP_DTYPES", "add_ordered", "ordered", "ulp_delta", "unordered"]

ULP_DTYPES = frozenset(
    {
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
"""Dtypes the ULP encoding may carry (floats; integers and bools use XOR or overwrite)."""

_W = TypeVar("_W", bound=np.unsignedinteger[Any])


def _sign(words: npt.NDArray[Any]) -> Any:
    return words.dtype.type(1 << (8 * words.dtype.itemsize - 1))


def ordered(words: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """The order-preserving pattern of unsigned stored words (a new array)."""
    sign = _sign(words)
    negative = (words & sign) != 0
    return np.where(negative, ~words, words | sign)


def unordered(words: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """Inverse of :func:`ordered` (a new array)."""
    sign = _sign(words)
    positive = (words & sign) != 0
    return np.where(positive, words ^ sign, ~words)


def ulp_delta(new: npt.NDArray[_W], old: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """``(ordered(new) - ordered(old)) mod 2**w``: the ULP encoding's value of each entry."""
    with np.errstate(over="ignore"):
        return ordered(new) - ordered(old)


def add_ordered(stored: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``unordered(ordered(stored) + delta)`` on torch integer views of one width.

    ``stored`` and ``delta`` are same-dtype integer tensors (torch's bit views: ``uint8``,
    ``int16``, ``int32``, ``int64``); arithmetic wraps modulo ``2**w`` like the numpy side.
    Returns a new tensor; ``stored`` is not modified.
    """
    if stored.dtype != delta.dtype:
        raise TypeError(f"dtype mismatch: {stored.dtype} vs {delta.dtype}")
    width = stored.element_size() * 8
    if stored.dtype == torch.uint8:
        sign = torch.tensor(0x80, dtype=torch.uint8, device=stored.device)
        neg = (stored & sign) != 0
        o = torch.where(neg, ~stored, stored | sign) + delta
        pos = (o & sign) != 0
        return torch.where(pos, o ^ sign, ~o)
    # Signed views: the sign bit is the integer's sign; ``| min`` sets it, ``^ min`` flips it.
    low = torch.tensor(-(1 << (width - 1)), dtype=stored.dtype, device=stored.device)
    neg = stored < 0
    o = torch.where(neg, ~stored, stored | low) + delta
    pos = o < 0
    return torch.where(pos, o ^ low, ~o)
