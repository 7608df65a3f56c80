"""Whether processes are gone, checked by pid (never by name): what a fleet, a Ray cluster
or a test started and stopped."""

from __future__ import annotations

import os
import time

__all__ = ["alive", "wait_gone"]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie of ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return os.path.exists(f"/proc/{pid}")


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> None:
    """Wait up to ``timeout_s`` for every process of ``pids`` to be gone; an
    ``AssertionError`` names those left."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left behind: {left}"
