"""Rice-split streams of a version 2 or 3 body joined back into words (paper App. D): a byte symbol
per word (the quotient, or a cap that defers to an escape word), and per Rice parameter a
stream of raw remainder bits.

Versions 2 and 3 split both the gaps between an item's positions and its zigzagged ULP values this
way; the joins check that each escape word is at least the cap and every word within its bound,
and the C kernels' join reports its failures as a status that :func:`join_failure` turns into
the rejection.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dcr.errors import PayloadRejected
from dcr.wire.decode.body import Body, reject
from dcr.wire.split import remainder_bytes, unpack_bits

__all__ = [
    "U64",
    "Reject",
    "check_escapes",
    "join",
    "join_failure",
    "per_k",
    "remainders",
    "streams",
]

U64 = np.uint64


class Reject(Protocol):
    """Makes the rejection of a check on the items (``item``: the item it names, if any)."""

    def __call__(self, message: str, check: str, item: int | None = None) -> PayloadRejected: ...


def per_k(ks: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64]) -> dict[int, int]:
    """Rice parameter (above 0, below 64) -> words split with it, ascending."""
    totals = np.zeros(64, dtype=np.int64)
    np.add.at(totals, ks, sizes)
    return {int(k): int(totals[k]) for k in np.flatnonzero(totals) if k > 0}


def remainders(
    body: Body, ks: dict[int, int], attempt: int
) -> dict[int, npt.NDArray[np.unsignedinteger[Any]]]:
    """The remainder streams of ``ks`` (parameter -> words), read in order and unpacked."""
    out = {}
    for k, m in ks.items():
        words = unpack_bits(body.read(remainder_bytes(m, k)), k, m)
        if words is None:
            raise reject(attempt, "a padding bit of a remainder stream is set", "schema")
        out[k] = words
    return out


def _padding_ok(stream: npt.NDArray[np.uint8], m: int, k: int) -> bool:
    """Whether the bits after the last of ``m`` ``k``-bit remainders are zero."""
    used = m * (k % 8)
    return not used % 8 or not int(stream[-1]) >> (used % 8)


def streams(body: Body, ks: dict[int, int], attempt: int) -> list[Any]:
    """The remainder streams of ``ks`` (parameter -> words), read in order, as the C join
    takes them: a list indexed by parameter, ``None`` where absent."""
    out: list[Any] = [None] * 64
    for k, m in ks.items():
        stream = body.read(remainder_bytes(m, k))
        if not _padding_ok(stream, m, k):
            raise reject(attempt, "a padding bit of a remainder stream is set", "schema")
        out[k] = stream
    return out


def check_escapes(
    caps: int, escapes: npt.NDArray[np.unsignedinteger[Any]], cap: int, reject: Reject
) -> None:
    """One escape word per cap symbol, each at least the cap."""
    if caps != escapes.shape[0]:
        raise reject(f"{caps} escape symbols, {escapes.shape[0]} escape words", "bounds")
    if escapes.shape[0] and int(escapes.min()) < cap:
        raise reject("an escape word below the symbol cap", "bounds")


def join_failure(status: int, item: int | None, reject: Reject) -> PayloadRejected:
    """The rejection of a failed C join (status codes of ``dcr._kernels``)."""
    if status == 1:
        return reject("a Rice-coded word exceeds its bound", "bounds")
    if status == 2:
        return reject("a position is outside the tensor", "bounds", item)
    return reject("the symbol streams do not match the items", "bounds")


def join(
    symbols: npt.NDArray[np.uint8],
    cap: int,
    escapes: npt.NDArray[np.unsignedinteger[Any]],
    remainders: dict[int, npt.NDArray[np.unsignedinteger[Any]]],
    sizes: npt.NDArray[np.int64],
    ks: npt.NDArray[np.int64],
    limits: npt.NDArray[np.int64],
    reject: Reject,
) -> npt.NDArray[np.uint64]:
    """Words from Rice-split streams: item ``i`` owns ``sizes[i]`` of them, split with
    ``ks[i]`` and each at most ``limits[i]`` (``-1``: any u64).  Raises via ``reject``."""
    q = symbols.astype(U64)
    escaped = np.flatnonzero(symbols == cap)
    if escaped.shape[0] != escapes.shape[0]:
        raise reject(
            f"{escaped.shape[0]} escape symbols, {escapes.shape[0]} escape words", "bounds"
        )
    if escapes.shape[0]:
        if int(escapes.min()) < cap:
            raise reject("an escape word below the symbol cap", "bounds")
        q[escaped] = escapes
    members = sizes > 0
    if not members.any():
        return q
    ks_m, sizes_m = ks[members], sizes[members]
    top = limits[members].view(U64)
    uniform = bool((ks_m == ks_m[0]).all()) and bool((top == top[0]).all())
    if uniform:
        k_e: Any = U64(int(ks_m[0]))
        top_e: Any = top[0]
    else:
        k_e = np.repeat(ks_m.astype(U64), sizes_m)
        top_e = np.repeat(top, sizes_m)
    if bool((q > (top_e >> k_e)).any()):
        raise reject("a Rice-coded word exceeds its bound", "bounds")
    q <<= k_e
    for k, rem in remainders.items():
        if len(remainders) == 1 and uniform:
            q |= rem
        else:
            q[np.repeat(ks_m == k, sizes_m)] |= rem
    if bool((q > top_e).any()):
        raise reject("a Rice-coded word exceeds its bound", "bounds")
    return q
