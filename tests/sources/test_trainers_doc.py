"""The FSDP2 example of docs/trainers.md runs (two gloo processes) and ends bit-exact."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def example(marker: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if marker in b]
    return block


def test_fsdp_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "fsdp_example.py"
    script.write_text(example("FsdpSource("))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("bit-exact") == 3
    assert "2.weight@0,0" not in done.stdout  # Sequential names: 0., 1., 3.
    assert "3.weight@250,0" in done.stdout
