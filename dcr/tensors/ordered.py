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

_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _flip_mask(signed: npt.NDArray[Any], *, invert: bool) -> npt.NDArray[Any]:
    """``(x >> (w-1)) | MIN`` on the signed view (``~x`` first when ``invert``): all ones for
    a set sign bit, else only the sign bit -- the XOR mask that (un)orders a word."""
    width = signed.dtype.itemsize * 8
    mask = np.invert(signed) if invert else signed.copy()
    np.right_shift(mask, width - 1, out=mask)  # arithmetic: 0 or -1
    np.bitwise_or(mask, signed.dtype.type(-(1 << (width - 1))), out=mask)
    return mask


def ordered(words: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """The order-preserving pattern of unsigned stored words (a new array)."""
    signed = words.view(_SIGNED[words.dtype.itemsize])
    mask = _flip_mask(signed, invert=False)
    np.bitwise_xor(mask, signed, out=mask)
    return mask.view(words.dtype)


def unordered(words: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """Inverse of :func:`ordered` (a new array)."""
    signed = words.view(_SIGNED[words.dtype.itemsize])
    mask = _flip_mask(signed, invert=True)
    np.bitwise_xor(mask, signed, out=mask)
    return mask.view(words.dtype)


def ulp_delta(new: npt.NDArray[_W], old: npt.NDArray[_W]) -> npt.NDArray[_W]:
    """``(ordered(new) - ordered(old)) mod 2**w``: the ULP encoding's value of each entry."""
    out = ordered(new)
    with np.errstate(over="ignore"):
        np.subtract(out, ordered(old), out=out)
    return out


def add_ordered(stored: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``unordered(ordered(stored) + delta)`` on torch integer views of one width.

    ``stored`` and ``delta`` are same-dtype integer tensors (torch's bit views: ``uint8``,
    ``int16``, ``int32``, ``int64``); arithmetic wraps modulo ``2**w`` like the numpy side.
    Returns a new tensor; ``stored`` is not modified.
    """
    if stored.dtype != delta.dtype:
        raise TypeError(f"dtype mismatch: {stored.dtype} vs {delta.dtype}")
    unsigned = stored.dtype == torch.uint8
    s = stored.view(torch.int8) if unsigned else stored
    d = delta.view(torch.int8) if unsigned else delta
    width = s.element_size() * 8
    low = -(1 << (width - 1))
    o = s ^ ((s >> (width - 1)) | low)  # arithmetic shift on the signed view
    o += d
    out = o ^ ((~o >> (width - 1)) | low)
    return out.view(torch.uint8) if unsigned else out
