"""The allocator setting of dcr's processes: freed entry arrays are reused, not re-faulted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dcr.alloc import keep_freed_memory

# Four 8 MiB arrays touched and freed per round: past glibc's default trim threshold, so an
# untuned process hands them back and faults them in again every round.
PROGRAM = """
import resource, sys
import numpy as np
if sys.argv[1] == "1":
    from dcr.alloc import keep_freed_memory
    assert keep_freed_memory()
def one_round():
    arrays = [np.ones(1 << 20, np.int64) for _ in range(4)]
    del arrays
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, "1" if tuned else "0"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


def test_freed_arrays_are_reused_without_page_faults() -> None:
    if not keep_freed_memory():
        pytest.skip("not glibc (or DCR_MALLOC_TUNING=0): the setting does not apply")
    untuned, tuned = _faults(False), _faults(True)
    # 10 rounds x 32 MiB is about 80,000 pages; measured here: 20,300 faults untuned, 0 tuned.
    assert untuned > 1000, f"the untuned allocator kept its memory ({untuned} faults)"
    assert tuned * 20 < untuned, (tuned, untuned)


def test_the_setting_can_be_turned_off() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from dcr.alloc import keep_freed_memory as k; print(k())"],
        capture_output=True, text=True, timeout=120, check=True,
        env={"DCR_MALLOC_TUNING": "0", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.stdout.strip() == "False"
