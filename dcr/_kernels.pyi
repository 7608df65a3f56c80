"""Type stub of the C kernels (``dcr/_kernels.c``); see :mod:`dcr.native`."""

from typing import Any

from numpy.typing import NDArray

def scan(
    new: NDArray[Any], old: NDArray[Any], kind: int, pos: NDArray[Any], out: NDArray[Any],
    out2: NDArray[Any],
) -> int: ...
def isa() -> tuple[int, int]: ...
def set_isa(level: int) -> int: ...
def split_gaps(
    indices: NDArray[Any], k: int, cap: int, symbols: NDArray[Any], at_sym: int,
    remainders: NDArray[Any], stream_n: int, at_rem: int, escapes: NDArray[Any] | None,
) -> int: ...
def split_ulp(
    values: NDArray[Any], k: int, cap: int, symbols: NDArray[Any], at_sym: int,
    remainders: NDArray[Any], stream_n: int, at_rem: int, escapes: NDArray[Any] | None,
) -> int: ...
def rmw(flat: NDArray[Any], pos: NDArray[Any], values: NDArray[Any], encoding: int,
        check: bool) -> int: ...
def rmw_mapped(
    flat: NDArray[Any], indices: NDArray[Any], values: NDArray[Any], lo: int, hi: int,
    src_offset: int, dst_offset: int, dims: NDArray[Any], encoding: int, check: bool,
) -> tuple[int, int]: ...
def increasing(indices: NDArray[Any]) -> bool: ...
