"""The decompressed body of a received payload and what both format versions read from it
(paper App. D).

The body is one zstd frame, decompressed as a stream part by part (:class:`Body`), never more
than asked for; a version 1 item table is read from a length-limited region of it in chunks
(:class:`Chunks`).  Word classes (one array per width, plain or byte planes) are read straight
into native words.  :func:`check_tensor` holds the checks of a tensor's name, shape and dtype
that every version makes, against :class:`~dcr.wire.format.DecodeLimits` and the receiver's
catalog.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from dcr.errors import PayloadRejected
from dcr.tensors.bits import DTYPE_CODES, dtype_name, numpy_bits_dtype
from dcr.tensors.records import TensorSpec
from dcr.wire.format import (
    V1,
    WINDOW_LOG_MAX,
    WINDOW_LOG_MAX_V1,
    WORD_WIDTHS,
    DecodeLimits,
    ValueLayout,
)
from dcr.wire.planes import join_planes, word_dtype

__all__ = [
    "NATIVE_WORDS",
    "Body",
    "Chunks",
    "check_tensor",
    "class_matrices",
    "class_words",
    "read_words",
    "reject",
    "take_words",
]

NATIVE_WORDS = {dt: np.dtype(numpy_bits_dtype(dt)) for dt in DTYPE_CODES}
"""The word dtype each tensor dtype's stored bits travel as."""


def reject(attempt: int, message: str, check: str, tensor: str | None = None) -> PayloadRejected:
    """The rejection of ``attempt``'s payload by ``check`` (of ``tensor``, when named)."""
    return PayloadRejected(message, attempt=attempt, tensor=tensor, check=check)


def _frame_end(compressed: memoryview) -> int | None:
    """Length of the zstd frame at the start of ``compressed`` from its block headers
    (RFC 8878 §3.1.1), or ``None`` when it is not a complete frame.  O(blocks)."""
    try:
        pos = zstandard.frame_header_size(compressed)
    except zstandard.ZstdError:
        return None
    size = len(compressed)
    if pos > size or size < 5:
        return None
    checksum = bool(compressed[4] & 0x04)
    while True:
        if pos + 3 > size:
            return None
        header = compressed[pos] | compressed[pos + 1] << 8 | compressed[pos + 2] << 16
        pos += 3
        block_type = (header >> 1) & 3
        pos += 1 if block_type == 1 else header >> 3
        if block_type == 3 or pos > size:
            return None
        if header & 1:
            break
    return pos + 4 if checksum else pos


class Body:
    """The decompressed body, read part by part; never more than asked for is allocated.

    A frame that states its content size (it must equal the declared body length) is
    decompressed as a stream; a version 1 frame that does not is decompressed at once into a
    buffer of the declared length, as it always was.
    """

    def __init__(self, compressed: memoryview, size: int, attempt: int, version: int) -> None:
        self.attempt = attempt
        self.remaining = size
        self._stream: Any = None
        self._flat: bytes | None = None
        self._pos = 0
        try:
            frame = zstandard.get_frame_parameters(compressed)
        except zstandard.ZstdError as exc:
            raise self.reject(f"not a zstd frame: {exc}") from exc
        end = _frame_end(compressed)
        if end is None:
            raise self.reject("not one complete zstd frame")
        if end != len(compressed):
            raise self.reject(f"{len(compressed) - end} bytes after the zstd frame")
        known = frame.content_size != zstandard.CONTENTSIZE_UNKNOWN
        if known and frame.content_size != size:
            raise self.reject(
                f"zstd frame holds {frame.content_size} bytes, header declares {size}"
            )
        if version != V1 and not known:
            raise self.reject("the zstd frame does not state its content size")
        # A single-segment frame has no window descriptor: its window is its content size.
        window = 1 << (WINDOW_LOG_MAX_V1 if version == V1 else WINDOW_LOG_MAX)
        if frame.window_size > window:
            raise self.reject(
                f"zstd window of {frame.window_size} bytes exceeds {window} "
                "(a single-segment frame's window is its content size)"
            )
        if known:
            self._stream = zstandard.ZstdDecompressor().stream_reader(
                compressed, read_across_frames=False
            )
        else:
            try:
                self._flat = zstandard.ZstdDecompressor().decompress(
                    compressed, max_output_size=size, allow_extra_data=False
                )
            except zstandard.ZstdError as exc:
                raise self.reject(f"zstd: {exc}") from exc
            if len(self._flat) != size:
                raise self.reject(f"decompressed {len(self._flat)} bytes, header declares {size}")

    def reject(self, message: str) -> PayloadRejected:
        return PayloadRejected(message, attempt=self.attempt, check="decompress")

    def read(self, n: int) -> npt.NDArray[np.uint8]:
        """The next ``n`` body bytes (the caller has checked ``n`` against ``remaining``)."""
        assert 0 <= n <= self.remaining
        if self._flat is not None:
            self.remaining -= n
            out = np.frombuffer(self._flat, dtype=np.uint8, count=n, offset=self._pos)
            self._pos += n
            return out
        buf = np.empty(n, dtype=np.uint8)
        self.read_into(buf)
        return buf

    def read_into(self, buf: npt.NDArray[np.uint8]) -> None:
        """The next ``len(buf)`` body bytes into ``buf`` (C-contiguous; length checked by the
        caller against ``remaining``)."""
        n = int(buf.shape[0])
        assert 0 <= n <= self.remaining
        if self._flat is not None:
            buf[...] = self.read(n)
            return
        self.remaining -= n
        view = memoryview(buf.data)
        got = 0
        try:
            while got < n:
                k = self._stream.readinto(view[got:])
                if not k:
                    raise self.reject("the zstd frame ends before the declared body length")
                got += k
        except zstandard.ZstdError as exc:
            raise self.reject(f"zstd: {exc}") from exc

    def finish(self) -> None:
        """Check that the whole body was consumed and the frame ends there."""
        assert self.remaining == 0
        if self._stream is not None:
            try:
                extra = self._stream.read(1)
            except zstandard.ZstdError as exc:
                raise self.reject(f"zstd: {exc}") from exc
            if extra:
                raise self.reject("the zstd frame holds more than the declared body length")


class Chunks:
    """A length-limited region of the body, read in chunks of at most 64 KiB beyond what is
    asked for, so that a long table is never held whole."""

    _CHUNK = 64 << 10

    def __init__(self, body: Body, size: int) -> None:
        self.body = body
        self.left = size
        self.buf = b""
        self.pos = 0

    def take(self, k: int) -> bytes | None:
        """The next ``k`` bytes, or ``None`` if the region ends first."""
        have = len(self.buf) - self.pos
        if k > have + self.left:
            return None
        if k > have:
            more = min(self.left, max(k - have, self._CHUNK))
            self.buf = self.buf[self.pos :] + self.body.read(more).tobytes()
            self.left -= more
            self.pos = 0
        out = self.buf[self.pos : self.pos + k]
        self.pos += k
        return out

    @property
    def rest(self) -> int:
        return len(self.buf) - self.pos + self.left


def check_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    attempt: int,
    limits: DecodeLimits,
    catalog: Mapping[str, TensorSpec] | None,
) -> int:
    """``numel`` of a tensor after the checks every version makes; raises on failure."""
    numel = math.prod(shape)
    if numel > limits.max_numel:
        raise reject(
            attempt, f"shape {list(shape)} exceeds {limits.max_numel} elements", "shape", name
        )
    if catalog is not None:
        spec = catalog.get(name)
        if spec is None:
            raise reject(attempt, "tensor is not in the receiver's catalog", "name", name)
        if spec.dtype != dtype:
            raise reject(
                attempt,
                f"dtype {dtype_name(dtype)} does not match {dtype_name(spec.dtype)}",
                "dtype",
                name,
            )
        if tuple(spec.shape) != shape:
            raise reject(
                attempt, f"shape {list(shape)} does not match {list(spec.shape)}", "shape", name
            )
    return numel


def class_matrices(
    data: npt.NDArray[np.uint8], totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.uint8]]:
    """``(n, width)`` (plain) or ``(width, n)`` (byte planes) views of each class in ``data``."""
    matrices: dict[int, npt.NDArray[np.uint8]] = {}
    offset = 0
    for width in WORD_WIDTHS:
        n = totals[width]
        flat = data[offset : offset + n * width]
        matrices[width] = (
            flat.reshape(n, width) if layout is ValueLayout.PLAIN else flat.reshape(width, n)
        )
        offset += n * width
    return matrices


def take_words(
    matrix: npt.NDArray[np.uint8],
    start: int,
    count: int,
    dtype: np.dtype[np.unsignedinteger[Any]],
    layout: ValueLayout,
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """``count`` words from ``start`` of a class matrix, copied out as native ``dtype``."""
    if layout is ValueLayout.PLAIN:
        rows = matrix[start : start + count]
        return rows.view(word_dtype(dtype.itemsize)).reshape(count).astype(dtype, copy=True)
    return join_planes(matrix[:, start : start + count], dtype)


def class_words(
    data: npt.NDArray[np.uint8], totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """Every width class of ``data`` as one native word array per width."""
    return {
        w: take_words(m, 0, totals[w], np.dtype(f"u{w}"), layout)
        for w, m in class_matrices(data, totals, layout).items()
    }


_JOIN = 1 << 22
"""Bytes of one byte plane read at once while words are joined from their planes."""


def read_words(
    body: Body, totals: dict[int, int], layout: ValueLayout
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """Every width class of the next ``sum(w * totals[w])`` body bytes as one native word
    array per width, read straight into the words (a byte plane a piece at a time): the
    classes are never held twice."""
    out: dict[int, npt.NDArray[np.unsignedinteger[Any]]] = {}
    for w in WORD_WIDTHS:
        n = totals[w]
        words = np.empty(n, dtype=word_dtype(w))
        raw = words.view(np.uint8)
        if layout is ValueLayout.PLAIN or w == 1:
            body.read_into(raw)
        else:
            matrix = raw.reshape(n, w)
            for b in range(w):
                for lo in range(0, n, _JOIN):
                    matrix[lo : lo + _JOIN, b] = body.read(min(_JOIN, n - lo))
        out[w] = words.astype(np.dtype(f"u{w}"), copy=False)
    return out
