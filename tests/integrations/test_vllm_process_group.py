"""How the launcher's engines die: a process group killed as a whole, and an engine process
(``--stop-with-parent``) that takes its group down once the launcher is gone -- whatever it
is doing then.  Real processes, no vLLM: the engine stands in as a Python process that
starts children, as vLLM's engine core and workers are."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dcr.fleet.processes import _kill, _Proc

ENGINE = """
import subprocess, sys, time
from dcr.integrations.vllm.server import _stop_with_parent
_stop_with_parent()
children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            for _ in range(2)]
print(" ".join(str(c.pid) for c in children), flush=True)
time.sleep(120)
"""

LAUNCHER = """
import subprocess, sys
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(engine.pid, flush=True)
engine.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_killing_an_engine_kills_its_process_group(tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    proc = _Proc(name="engine-e0", role="engine", argv=[], group=True)
    proc.popen = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.popen.stdout is not None
        children = [int(p) for p in proc.popen.stdout.readline().split()]
        assert len(children) == 2 and all(_alive(c) for c in children)
        _kill(proc)
        assert _wait_gone([proc.popen.pid, *children], timeout_s=5.0) == []
    finally:
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait()
        if proc.popen.stdout is not None:
            proc.popen.stdout.close()


def test_an_engine_stops_with_its_launcher(tmp_path: Path) -> None:
    """SIGKILL of the launcher: the engine process (a group leader) notices it is orphaned
    and kills its group, children included."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ENGINE],
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = children = None
    try:
        assert launcher.stdout is not None
        engine = int(launcher.stdout.readline())
        children = [int(p) for p in launcher.stdout.readline().split()]
        assert _alive(engine) and all(_alive(c) for c in children)
        launcher.kill()
        launcher.wait()
        assert _wait_gone([engine, *children]) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if engine is not None and _alive(engine):
            os.killpg(engine, signal.SIGKILL)
        if launcher.stdout is not None:
            launcher.stdout.close()
