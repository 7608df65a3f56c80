"""The runnable example of docs/api.md that refits a running vLLM engine runs, as a program
of its own (vLLM starts its engine core by spawning, which re-imports the main module)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _engine_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    found = [b for b in blocks if "join_fleet(" in b and '__name__ == "__main__"' in b]
    assert len(found) == 1
    return found[0]


def test_the_engine_example_refits_a_serving_engine(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_engine_example())
    # vLLM binds IPC sockets under TMPDIR, whose paths may not exceed 107 bytes: a short
    # private directory, not the (deep) pytest one.
    tmp = tempfile.mkdtemp(prefix="dcr-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=tmp)
    try:
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
            start_new_session=True,
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("before: (0, g0)") for line in lines), done.stdout
    assert any(line.startswith("after:  (1, ") for line in lines), done.stdout
    assert any("the gate was closed for" in line for line in lines), done.stdout
