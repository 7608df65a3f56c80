"""The OS processes a fleet launcher starts: one child (or process group) per role, its last
words when it crashed, and how it is signalled and killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class _Proc:
    name: str
    role: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    group: bool = False
    """Runs in a process group of its own (an engine and its children), signalled as one."""
    env: dict[str, str] = field(default_factory=dict)
    stop_s: float = 10.0
    down_until: float = 0.0
    """Monotonic time before which supervision does not restart it (a planned fault)."""


def _last_line(log: Path) -> str:
    """``": <the last line of log>"`` (what a crashed process said last), or ``""``."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [x for x in lines if x]
    return f": {lines[-1][:300]}" if lines else ""


_GROUP_GONE_S = 60.0
"""How long the processes of a killed group may take to disappear."""


def _signal(proc: _Proc, signum: int) -> None:
    """Send ``signum`` to the process, or to its whole group."""
    assert proc.popen is not None
    if proc.group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signum)
    elif proc.popen.poll() is None:
        proc.popen.send_signal(signum)


def _kill(proc: _Proc) -> None:
    """SIGKILL the process (and every process left in its group) and wait until gone."""
    assert proc.popen is not None
    _signal(proc, signal.SIGKILL)
    proc.popen.wait()
    if proc.group:
        deadline = time.monotonic() + _GROUP_GONE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.05)
