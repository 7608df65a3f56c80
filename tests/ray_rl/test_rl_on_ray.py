"""``dcr rl --backend ray``: the GRPO loop with its fleet on a Ray cluster of four nodes (head,
trainer node, two rollout nodes) equals the same loop refitted densely, bit for bit, also when
the engine actor is killed mid-refit twice and a trainer rank once (``ray.kill``).

Runs in ``.venv-vllm`` inside a private network namespace with loopback alone (``make
test-ray-rl``); the top-level conftest leaves this directory out elsewhere.  Afterwards no
process of the run (no raylet, worker, engine core) survives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dcr.ray.netns import only_loopback
from dcr.testing.rl import calm_refits

pytestmark = pytest.mark.vllm

STEPS = 4
BATCH = ("--prompts", "4", "--group-size", "4")
"""The runs' batch (the loop's default is 8 x 8): most of a run is starting processes."""
COMPARED = ("reward", "kl", "loss", "tokens_sha256")


def _rl(directory: Path, *args: str) -> dict[str, Any]:
    """``dcr rl ... --json`` in its own process; its JSON answer, after checking that no
    process whose command line or working directory names the run outlived it."""
    done = subprocess.run(
        [sys.executable, "-m", "dcr.cli", "rl", "--steps", str(STEPS), "--dir", str(directory),
         "--json", *BATCH, *args],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert _ray_processes() == [], "processes of the Ray cluster outlived the run"
    return result


def _ray_processes() -> list[int]:
    """Live processes of a Ray cluster (raylet, GCS, workers) or of a vLLM engine in this
    network namespace (the test's own: other suites' clusters run in namespaces of theirs)."""
    found = []
    ours = os.readlink("/proc/self/ns/net")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "net") != ours:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        # A worker hosting an actor renames itself "ray::<Actor>" (an idle one "ray::IDLE").
        ray = any(m in cmdline for m in ("ray/core/src/ray", "default_worker.py", "ray::"))
        if (ray or "EngineCore" in cmdline) and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: the same loop refitted densely (processes, vLLM's own loader)."""
    assert only_loopback(), "run it with `make test-ray-rl` (a private network)"
    return _rl(tmp_path_factory.mktemp("dense"), "--refit", "dense")


# The dense reference runs in this test's setup, which its timeout covers.
@pytest.mark.timeout(3600)
def test_the_rl_loop_on_ray_with_actors_killed_equals_dense_refits(
    tmp_path: Path, dense: dict[str, Any]
) -> None:
    ray = _rl(tmp_path / "ray", "--backend", "ray", "--faults")
    assert ray["backend"] == "ray" and ray["ray_start_s"] > 0
    roles = [k["role"] for k in ray["killed"]]
    assert roles.count("engine") == 2 and roles.count("trainer") == 1, ray["killed"]
    assert [r["step"] for r in ray["steps"]] == list(range(1, STEPS + 1))
    for a, b in zip(ray["steps"], dense["steps"], strict=True):
        for key in COMPARED:
            assert a[key] is not None and a[key] == b[key], (a["step"], key, a[key], b[key])
    assert ray["final_weights_sha256"] == dense["final_weights_sha256"]
    dense_bytes = dense["steps"][0]["payload_bytes"]
    calm = calm_refits(ray)
    assert calm and all(0 < r["payload_bytes"] < dense_bytes for r in calm), ray["steps"]


def test_the_embedding_example_trains_and_syncs_through_dcr(
    tmp_path: Path, dense: dict[str, Any]
) -> None:
    """``examples/ray/rl_stack.py`` (docs/ray.md): a trainer worker group and a rollout actor
    of the user's own, weight sync through dcr; the same policy, task and seeds as ``dcr rl``,
    so its rewards are the dense run's, and the engine ends on the last version."""
    steps = 3
    example = Path(__file__).parents[2] / "examples" / "ray" / "rl_stack.py"
    done = subprocess.run(
        [sys.executable, str(example), "--local", "--steps", str(steps), "--dir", str(tmp_path),
         *BATCH],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert lines == [
        f"step {k}: rollouts of version [{k - 1}], reward {dense['steps'][k - 1]['reward']:.4f}, "
        f"committed version {k}"
        for k in range(1, steps + 1)
    ], done.stdout
    assert f"the engine holds version {steps}" in done.stdout
    assert _ray_processes() == [], "processes of the Ray cluster outlived the example"
