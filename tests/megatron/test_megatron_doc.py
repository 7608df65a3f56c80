"""The Megatron-Core example of docs/trainers.md runs under torchrun (two gloo processes): at
TP=2, and at PP=2 with two virtual pipeline chunks per stage."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


@pytest.mark.parametrize(
    ("args", "overwrites"),
    [([], "19 of 47 tensors"), (["--tp", "1", "--pp", "2", "--vpp", "2"], "17 of 47 tensors")],
    ids=["tp2", "pp2-vpp2"],
)
def test_megatron_example_runs(tmp_path: Path, args: list[str], overwrites: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    (block,) = [b for b in blocks if "MegatronSource(" in b]
    script = tmp_path / "megatron_refit.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert done.stdout.count("receiver == dense load of export_hf_weights, bit for bit") == 2
    assert f"{overwrites} travel as overwrites" in done.stdout
    assert "FusedQKV" in done.stdout and "residual" not in done.stdout
