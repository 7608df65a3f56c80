"""What both format versions write for an item (paper App. D): its checked metadata (name bytes
and packed shape, the encoding the version allows) and its words grouped into width classes.

Items are validated before anything is produced; a bad item raises
:class:`~dcr.errors.ConfigError`.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from dcr.errors import ConfigError
from dcr.tensors.bits import DTYPE_CODES, numpy_bits_dtype
from dcr.tensors.ordered import ULP_DTYPES
from dcr.tensors.records import Encoding, Item
from dcr.wire.format import U64, V1, WORD_WIDTHS

__all__ = ["Classes", "empty_classes", "entry_metadata"]

_V1_ENCODINGS = (Encoding.XOR, Encoding.OVERWRITE)
_V2_ENCODINGS = tuple(Encoding)
_BITS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}


def _check_arrays(item: Item) -> None:
    """``Item.validate`` without its monotonicity pass, which
    :func:`~dcr.wire.encode.v2.body_v2` does on the differences it computes anyway; raises
    :class:`ConfigError`."""
    idx, values = item.listed, item.values
    if idx is not None and (
        not isinstance(idx, np.ndarray) or idx.dtype != np.int64 or idx.ndim != 1
    ):
        raise ConfigError("indices must be a 1-D int64 array", tensor=item.name)
    bits_dtype = _BITS.get(item.dtype)
    if bits_dtype is None:
        raise ConfigError(f"dtype {item.dtype} is not supported", tensor=item.name, check="dtype")
    n = item.count
    if not isinstance(values, np.ndarray) or values.dtype != bits_dtype or values.shape != (n,):
        raise ConfigError(f"values must be {bits_dtype.name}[{n}]", tensor=item.name)
    if n:
        first, last = item.bounds
        if first < 0 or last >= math.prod(item.shape):
            raise ConfigError("index out of range", tensor=item.name, check="bounds")


def entry_metadata(item: Item, attempt: int, version: int) -> tuple[bytes, bytes]:
    """Validated name bytes and packed shape of ``item``; raises :class:`ConfigError`.
    Versions 2 and 3 leave the check that indices increase to its caller."""
    if version == V1:
        item.validate()
    else:
        _check_arrays(item)
    try:
        name = item.name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            "name is not valid UTF-8", attempt=attempt, tensor=item.name, check="name"
        ) from exc
    if not 0 < len(name) <= 0xFFFF:
        raise ConfigError(
            f"name must have 1..65535 UTF-8 bytes, has {len(name)}",
            attempt=attempt,
            tensor=item.name,
            check="name",
        )
    if len(item.shape) > 0xFF or not all(0 <= d <= U64 for d in item.shape):
        raise ConfigError(
            f"shape {item.shape} cannot be encoded",
            attempt=attempt,
            tensor=item.name,
            check="shape",
        )
    allowed = _V1_ENCODINGS if version == V1 else _V2_ENCODINGS
    if item.encoding not in allowed:
        raise ConfigError(
            f"encoding {item.encoding!r} cannot be written in format version {version}",
            attempt=attempt,
            tensor=item.name,
            check="encoding",
        )
    if item.encoding is Encoding.ULP and item.dtype not in ULP_DTYPES:
        raise ConfigError(
            f"ULP encoding of a {item.dtype} tensor (floats only)",
            attempt=attempt,
            tensor=item.name,
            check="encoding",
        )
    return name, struct.pack(f"<{len(item.shape)}Q", *item.shape)


Classes = dict[int, list[npt.NDArray[np.unsignedinteger[Any]]]]


def empty_classes() -> Classes:
    return {w: [] for w in WORD_WIDTHS}
