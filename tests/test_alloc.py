"""The allocator setting of dcr's processes: freed entry arrays are reused, not re-faulted."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Four 8 MiB arrays touched and freed per round: past glibc's default trim threshold, so an
# untuned process hands them back and faults them in again every round.
PROGRAM = """
import resource, sys
import numpy as np
from dcr.alloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else False
def one_round():
    arrays = [np.ones(1 << 20, np.int64) for _ in range(4)]
    del arrays
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    one_round()
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(tuned: bool, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, "1" if tuned else "0"],
        capture_output=True, text=True, timeout=120, check=True, env={**clean, **env},
    )  # fmt: skip
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt parameters only",
)
def test_freed_arrays_are_reused_without_page_faults() -> None:
    applied, tuned = _run(True)
    assert applied, "keep_freed_memory() did not apply on glibc"
    _, untuned = _run(False)
    # 10 rounds x 32 MiB is about 80,000 pages; measured here: 20,300 faults untuned, 0 tuned.
    assert untuned > 1000, f"the untuned allocator kept its memory ({untuned} faults)"
    assert tuned * 20 < untuned, (tuned, untuned)


@pytest.mark.parametrize(
    "env",
    [
        {"DCR_MALLOC_TUNING": "0"},
        {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
    ids=["off", "mmap-threshold-set", "tunables-set"],
)
def test_settings_of_the_environment_are_kept(env: dict[str, str]) -> None:
    applied, _ = _run(True, **env)
    assert not applied
