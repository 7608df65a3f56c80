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


RUNNABLE = 5


def test_there_are_runnable_examples():
    assert len(examples()) == RUNNABLE


def _embedding(block: str) -> bool:
    return "open_coordinator" in block and "asyncio.run(main())" in block


def test_the_embedding_example_is_a_runnable_example():
    # The engine example defines every name it uses and runs as a whole program.
    assert sum(_embedding(b) for b in examples()) == 1


@pytest.mark.parametrize("index", range(RUNNABLE))
def test_api_example_runs(index, tmp_path, capsys):
    script = tmp_path / f"example_{index}.py"
    script.write_text(examples()[index])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    if index == 0:
        assert "changed elements" in out and "payload bytes" in out
    if _embedding(examples()[index]):
        assert "aborted - operator abort: hold this step" in out
        assert "committed - version 1" in out
