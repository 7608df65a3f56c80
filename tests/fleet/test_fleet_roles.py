"""Roles started by hand from a fleet file: relay ports chosen at run time, and errors that
say what is wrong in one line instead of a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcr.errors import ConfigError
from dcr.fleet.config import load_fleet


def _fleet(directory: Path, trainer: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fleet.toml"
    path.write_text(f"""[fleet]
run_dir = "run"
{trainer}
[[rollout]]
name = "node0"
port = 0
receivers = [{{ name = "r0", runtime = "torch", options = {{ factory = "m:f" }} }}]
""")
    return path


def test_a_relay_port_left_at_zero_says_how_to_start_the_node(tmp_path: Path) -> None:
    cfg = load_fleet(_fleet(tmp_path))
    with pytest.raises(ConfigError, match=r"start `dcr relay --fleet .* --node node0` first"):
        cfg.ports()


def test_a_relay_started_by_hand_records_the_port_it_bound(tmp_path: Path) -> None:
    cfg = load_fleet(_fleet(tmp_path))
    relay = subprocess.Popen(
        [sys.executable, "-m", "dcr.cli", "relay", "--fleet", str(cfg.path), "--node", "node0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        address = cfg.address("node0")  # waits for the node to record its port
        port = int(address.rsplit(":", 1)[1])
        assert address == f"tcp://127.0.0.1:{port}" and port > 0
        assert json.loads(cfg.ports_file.read_text()) == {"node0": port}
        events = cfg.events_dir / "relay-node0.jsonl"
        deadline = time.monotonic() + 60
        while not events.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        started = json.loads(events.read_text().splitlines()[0])
        assert started["event"] == "started" and started["address"] == address
    finally:
        relay.terminate()
        relay.wait(30)


@pytest.mark.parametrize(
    ("trainer", "expected"),
    [
        ('[trainer]\nkind = "no_such_module:train"\nranks = 1\n',
         "[trainer] kind = 'no_such_module:train': cannot import 'no_such_module:train'"),
        ('[trainer]\nkind = "nope"\nranks = 1\n',
         "no trainer named 'nope'; available: fsdp, synthetic"),
    ],
)  # fmt: skip
def test_a_role_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, trainer: str, expected: str
) -> None:
    path = _fleet(tmp_path, trainer)
    done = subprocess.run(
        [sys.executable, "-m", "dcr.cli", "owner", "--fleet", str(path), "--rank", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcr owner: ConfigError:"), done.stderr
    assert expected in lines[0]


def test_a_coordinator_waiting_on_members_that_never_report_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fleet file naming 2 trainer ranks and a receiver, none of which ever starts: the
    active coordinator names them, and what to check, instead of waiting without a word."""
    import anyio

    from dcr.fleet import coordinator

    path = _fleet(tmp_path, '[trainer]\nkind = "m:f"\nranks = 2\n')
    text = path.read_text().replace("port = 0", "port = 1")  # no relay node is needed here
    path.write_text(text)
    cfg = load_fleet(path)
    monkeypatch.setattr(coordinator, "SILENT_S", 0.5)

    async def main() -> None:
        with anyio.move_on_after(5):
            await coordinator.run_coordinator(cfg)

    anyio.run(main, backend="asyncio")
    lines = (cfg.events_dir / "coordinator.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    waiting = [e for e in events if e["event"] == "waiting"]
    assert waiting and waiting[0]["owners"] == ["o0", "o1"] and waiting[0]["receivers"] == ["r0"]
    assert "[trainer] ranks" in waiting[0]["message"]
    err = capsys.readouterr().err
    assert "dcr coordinator: waiting for members that never reported: owners ['o0', 'o1']" in err


def test_a_trainer_and_an_engine_that_serve_other_tensors_are_refused_before_starting(
    tmp_path: Path,
) -> None:
    """The ``fsdp`` trainer says what it trains (its version-0 checkpoint); an engine serving
    another checkpoint would fail every refit: the launcher refuses the fleet file before any
    process starts, naming both."""
    from dcr.fleet.launcher import Launcher
    from dcr.models.families import random_state_dict, tiny_config
    from dcr.models.hf import write_checkpoint

    small = tiny_config("llama")
    wide = tiny_config("llama", intermediate_size=2 * small["intermediate_size"])
    trained = write_checkpoint(
        tmp_path / "trained", small, "llama", random_state_dict(small, "llama")
    )
    served = write_checkpoint(tmp_path / "served", wide, "llama", random_state_dict(wide, "llama"))
    path = tmp_path / "fleet.toml"
    path.write_text(f"""[fleet]
run_dir = "run"
[trainer]
kind = "fsdp"
ranks = 2
[trainer.options]
steps = 2
checkpoint = "{trained}"
engine_ready = "{tmp_path / "ready.json"}"
state_dir = "{tmp_path / "state"}"
events_dir = "{tmp_path / "events"}"
[[rollout]]
name = "node0"
receivers = [{{ name = "r0" }}]
[[engine]]
name = "e0"
receivers = ["r0"]
model = "{served}"
""")
    launcher = Launcher(load_fleet(path))
    try:
        with pytest.raises(ConfigError) as caught:
            launcher.start()
    finally:
        launcher.stop()  # nothing to stop unless the check failed to refuse
    message = str(caught.value)
    assert "[trainer] kind = 'fsdp'" in message and "[[engine]] 'e0'" in message
    assert not launcher.procs and not (tmp_path / "run").exists()
