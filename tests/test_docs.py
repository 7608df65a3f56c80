"""The documentation's examples run: every ```python block of docs/api.md that is complete."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples() -> list[str]:
    blocks = BLOCK.findall((DOCS / "api.md").read_text())
    # Fragments that need a live loader or engine (receiver, vLLM) are shown, not run.
    return [b for b in blocks if "from dcr import" in b and "StateDictSource" in b and "w1" in b]


RUNNABLE = 3


def test_there_are_runnable_examples():
    assert len(examples()) == RUNNABLE


@pytest.mark.parametrize("index", range(RUNNABLE))
def test_api_example_runs(index, tmp_path, capsys):
    script = tmp_path / f"example_{index}.py"
    script.write_text(examples()[index])
    runpy.run_path(str(script), run_name="__main__")
    if index == 0:
        out = capsys.readouterr().out
        assert "changed elements" in out and "payload bytes" in out
