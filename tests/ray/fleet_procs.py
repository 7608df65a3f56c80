"""Checks that processes a test started are gone (by pid)."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left behind: {left}"
