"""Type stub of the C kernels (``dcr/_kernels.c``); see :mod:`dcr.native`."""

from typing import Any

from numpy.typing import NDArray

def scan(
    new: NDArray[Any],
    old: NDArray[Any],
    kind: int,
    pos: NDArray[Any],
    out: NDArray[Any],
    out2: NDArray[Any],
) -> int: ...
def isa() -> tuple[int, int]: ...
def set_isa(level: int) -> int: ...
def split_gaps(
    indices: NDArray[Any],
    k: int,
    cap: int,
    symbols: NDArray[Any],
    at_sym: int,
    remainders: NDArray[Any],
    stream_n: int,
    at_rem: int,
    escapes: NDArray[Any] | None,
) -> int: ...
def split_ulp(
    values: NDArray[Any],
    k: int,
    cap: int,
    symbols: NDArray[Any],
    at_sym: int,
    remainders: NDArray[Any],
    stream_n: int,
    at_rem: int,
    escapes: NDArray[Any] | None,
) -> int: ...
def value_k(values: NDArray[Any], step: int, cap: int) -> int: ...
def rmw(
    flat: NDArray[Any], pos: NDArray[Any], values: NDArray[Any], encoding: int, check: bool
) -> int: ...
def rmw_mapped(
    flat: NDArray[Any],
    indices: NDArray[Any],
    values: NDArray[Any],
    lo: int,
    hi: int,
    src_offset: int,
    dst_offset: int,
    dims: NDArray[Any],
    encoding: int,
    check: bool,
) -> tuple[int, int]: ...
def rmw_tasks(
    plans: list[tuple[Any, ...]], tasks: NDArray[Any], state: NDArray[Any], check: bool
) -> None: ...
def write_block(
    flat: NDArray[Any],
    dst_offset: int,
    values: NDArray[Any],
    src_offset: int,
    dims: NDArray[Any],
    encoding: int,
    check: bool,
) -> tuple[int, int]: ...
def increasing(indices: NDArray[Any]) -> bool: ...
def copy_at(dst: NDArray[Any], src: NDArray[Any], positions: NDArray[Any], shift: int) -> None: ...
def hash_plane(
    values: NDArray[Any], rowkey: NDArray[Any], colkey: int, r0: int, r1: int, c0: int, c1: int
) -> tuple[int, int]: ...
def spread_rows(
    local: NDArray[Any], period: int, gap: int, offset: int, out: NDArray[Any]
) -> None: ...
def join_locations(
    symbols: NDArray[Any],
    streams: list[Any],
    escapes: NDArray[Any],
    count: NDArray[Any],
    rice: NDArray[Any],
    k: NDArray[Any],
    start: NDArray[Any],
    numel: NDArray[Any],
    out: NDArray[Any],
) -> tuple[int, int]: ...
def join_values(
    symbols: NDArray[Any],
    streams: list[Any],
    escapes: NDArray[Any],
    count: NDArray[Any],
    k: NDArray[Any],
    limit: NDArray[Any],
    out: NDArray[Any],
    unzigzag: bool = ...,
) -> tuple[int, int]: ...
