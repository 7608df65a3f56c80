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

from dcr.errors import ConfigError

__all__ = [
    "DTYPE_CODES",
    "DTYPE_FROM_CODE",
    "bits",
    "bits_dtype",
    "changed_indices",
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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _width(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ConfigError(f"dtype {dtype_name(dtype)} is not supported", check="dtype")
    return torch.empty((), dtype=dtype).element_size()


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch integer dtype of the same width (bool and 1-byte types use ``uint8``)."""
    return _TORCH_BITS[_width(dtype)]


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


def changed_indices(
    new: npt.NDArray[np.generic], old: npt.NDArray[np.generic], *, block: int = _BLOCK
) -> npt.NDArray[np.int64]:
    """Flat C-order indices where the stored bits of ``new`` and ``old`` differ.

    Both arrays must be unsigned bit views of one shape (see :func:`bits`).  The comparison runs
    in blocks so no full-size temporary is created; numpy releases the GIL, so several calls
    run in parallel threads.
    """
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ConfigError(
            f"cannot compare {new.dtype}{list(new.shape)} with {old.dtype}{list(old.shape)}",
            check="shape",
        )
    a = new.reshape(-1)
    b = old.reshape(-1)
    n = a.shape[0]
    if n <= block:
        return np.flatnonzero(a != b).astype(np.int64, copy=False)
    buf = getattr(_scratch, "mask", None)
    if buf is None or buf.shape[0] < block:
        buf = _scratch.mask = np.empty(block, dtype=np.bool_)
    parts = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        mask = buf[: stop - start]
        np.not_equal(a[start:stop], b[start:stop], out=mask)
        hit = np.flatnonzero(mask)
        if hit.size:
            parts.append(hit.astype(np.int64, copy=False) + start)
    if not parts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(parts)
