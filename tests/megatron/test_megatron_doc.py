"""The Megatron-Core example of docs/trainers.md runs (two gloo processes, TP=2)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def test_megatron_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if "MegatronSource(" in b]
    script = tmp_path / "megatron_example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("receiver == export_hf_weights bit for bit") == 2
    assert "FusedQKV" in done.stdout and "residual" not in done.stdout
