"""What the launcher and the trainers leave open or delete on the machine they run on.

* The trainer's rendezvous store listens on the fleet's host only, never on every interface
  (torch's store server binds the wildcard address whatever host it is given).
* A run directory is cleared only when ``dcr fleet`` made it (its ``.dcr-run-dir`` marker),
  never when it holds the fleet file, and then only of what a fleet writes there; ``dcr rl``
  and the RL trainer's saved state keep files that are not theirs the same way.
* The synthetic trainer's checkpoint is written durably (file and directory fsynced), and one
  that cannot be read whole counts as absent: the rank computes the version instead of
  crashing again and again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fleet_helpers import small_fleet

from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.launcher import RUN_DIR_MARKER, Launcher
from dcr.fleet.model import FleetModel
from dcr.fleet.owner import _read_checkpoint, _resume, _save_checkpoint
from dcr.rl.run import MARKER as RL_MARKER
from dcr.rl.run import _fresh
from dcr.rl.trainer import _remove_version
from dcr.tensors.bits import bits

# -- the rendezvous store ---------------------------------------------------------------------


def _hex_address(address: str) -> str:
    """An IPv4 address as ``/proc/net/tcp`` writes it (host byte order, little-endian)."""
    return socket.inet_aton(address)[::-1].hex().upper()


def listening(pid: int, port: int) -> list[str]:
    """The local addresses (``/proc/net/tcp`` hex) of the sockets of ``pid`` that listen on
    ``port``, over IPv4 and IPv6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and fields[9] in inodes and int(hex_port, 16) == port:
                found.append(address)
    return found


def _client(host: str, port: int) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=60)
    )


def test_the_trainer_rendezvous_listens_on_the_fleet_host_only(tmp_path: Path) -> None:
    launcher = Launcher(small_fleet(tmp_path, refits=1))
    port = launcher._rendezvous()  # what _start_trainer does before starting the ranks
    try:
        addresses = listening(os.getpid(), port)
        assert addresses == [_hex_address("127.0.0.1")]  # not 0.0.0.0, not ::
        client = _client("127.0.0.1", port)  # a rank reaches it as before
        client.set("rank0", "up")
        assert launcher._trainer_store.get("rank0") == b"up"
    finally:
        launcher._trainer_store = None
    assert listening(os.getpid(), port) == []


def test_a_fleet_host_other_than_loopback_is_the_only_address_bound(tmp_path: Path) -> None:
    """A fleet spanning hosts names its own address as ``host``: the store binds that one
    (here 127.0.0.2, an address of this machine that is not 127.0.0.1) and no other."""
    cfg = dataclasses.replace(small_fleet(tmp_path, refits=1), host="127.0.0.2")
    launcher = Launcher(cfg)
    port = launcher._rendezvous()
    try:
        assert listening(os.getpid(), port) == [_hex_address("127.0.0.2")]
        _client("127.0.0.2", port).set("k", "v")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        launcher._trainer_store = None


def test_a_host_that_is_not_this_machine_is_refused_clearly(tmp_path: Path) -> None:
    cfg = dataclasses.replace(small_fleet(tmp_path, refits=1), host="192.0.2.1")  # TEST-NET-1
    with pytest.raises(ConfigError, match=r"rendezvous store on \[fleet\] host = '192\.0\.2\.1'"):
        Launcher(cfg)._rendezvous()


# -- the run directory ------------------------------------------------------------------------


def _fleet_with_run_dir(directory: Path, run_dir: str) -> FleetConfig:
    cfg = small_fleet(directory, refits=1)
    text = cfg.path.read_text().replace('run_dir = "run"', f"run_dir = {json.dumps(run_dir)}")
    cfg.path.write_text(text)
    return load_fleet(cfg.path)


def _tree(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` -> its bytes (``None``: a directory)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def test_run_dir_dot_is_refused_and_nothing_is_deleted(tmp_path: Path) -> None:
    cfg = _fleet_with_run_dir(tmp_path / "here", ".")
    (tmp_path / "here" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match="fleet file's directory or one above it") as info:
        Launcher(cfg)._prepare_run_dir()
    assert 'run_dir = "run"' in str(info.value)
    assert _tree(tmp_path) == before


def test_a_run_dir_above_the_fleet_file_is_refused_and_nothing_is_deleted(
    tmp_path: Path,
) -> None:
    cfg = _fleet_with_run_dir(tmp_path / "project" / "fleets", "..")
    (tmp_path / "project" / "README").write_text("mine")
    (tmp_path / "project" / RUN_DIR_MARKER).write_text("")  # even with a marker
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match="fleet file's directory or one above it"):
        Launcher(cfg)._prepare_run_dir()
    assert _tree(tmp_path) == before


def test_a_run_dir_dcr_did_not_make_is_refused_unless_empty(tmp_path: Path) -> None:
    cfg = _fleet_with_run_dir(tmp_path / "fleet", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "data.bin").write_bytes(b"\x00\x01")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError, match="not empty and was not made by dcr fleet") as info:
        Launcher(cfg)._prepare_run_dir()
    assert RUN_DIR_MARKER in str(info.value) and "new or empty directory" in str(info.value)
    assert _tree(tmp_path) == before
    (tmp_path / "elsewhere" / "data.bin").unlink()
    Launcher(cfg)._prepare_run_dir()  # empty: taken, and marked
    assert (tmp_path / "elsewhere" / RUN_DIR_MARKER).is_file()


def test_a_fresh_run_dir_is_made_and_marked_as_before(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1)
    assert not cfg.run_dir.exists()
    Launcher(cfg)._prepare_run_dir()
    names = sorted(p.name for p in cfg.run_dir.iterdir())
    assert names == sorted([RUN_DIR_MARKER, "logs", "ports.json", "faults.json"])
    assert set(json.loads(cfg.ports_file.read_text())) == {"node0", "node1"}


def test_only_what_a_fleet_writes_is_cleared_from_a_marked_run_dir(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1)
    Launcher(cfg)._prepare_run_dir()
    run = cfg.run_dir
    # What a run leaves: the SQLite record and the files beside it, events, logs, the
    # trainer's checkpoints, an engine's ready file, the lockstep go, a node's fetches.
    written = ["commit.db", "commit.db-wal", "commit.db-shm", "commit.db.written", "go.json",
               "engine-e0.ready.json", "ports.json.123.tmp", "events/o0.jsonl",
               "logs/o0.log", "trainer/o0.npz", "fetches/node1/abc", "objects/k"]  # fmt: skip
    for name in written:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("old run")
    # What is not the fleet's: a file, a folder, and a link named like the fleet's logs to a
    # folder outside (removed as a link, never followed).
    (run / "notes.txt").write_text("mine")
    (run / "results").mkdir()
    (run / "results" / "table.csv").write_text("a,b\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.log").write_text("mine too")
    (run / "logs" / "o0.log").unlink()
    (run / "logs").rmdir()
    (run / "logs").symlink_to(outside, target_is_directory=True)
    lines: list[str] = []
    Launcher(cfg, say=lines.append)._prepare_run_dir()
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / "results" / "table.csv").read_text() == "a,b\n"
    assert (outside / "keep.log").read_text() == "mine too"
    for name in written:
        assert not (run / name).exists(), name
    assert (run / "logs").is_dir() and not (run / "logs").is_symlink()
    assert lines == [f"kept what dcr fleet did not write in {run}: notes.txt, results"]


def test_dcr_rl_clears_only_what_a_run_wrote(tmp_path: Path) -> None:
    directory = tmp_path / "rl"
    _fresh(directory)
    for name in ("fleet.toml", "checkpoint-v0/model.safetensors", "run/logs/engine.log",
                 "trainer/LATEST", "objects/k", "seaweed/volume"):  # fmt: skip
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("old run")
    (directory / "analysis.ipynb").write_text("mine")
    _fresh(directory)
    assert sorted(p.name for p in directory.iterdir()) == [RL_MARKER, "analysis.ipynb"]
    assert (directory / "analysis.ipynb").read_text() == "mine"
    (directory / RL_MARKER).unlink()
    with pytest.raises(ConfigError, match="not a dcr rl run directory"):
        _fresh(directory)
    assert (directory / "analysis.ipynb").read_text() == "mine"


def test_the_rl_trainer_removes_only_its_own_files_of_an_older_version(tmp_path: Path) -> None:
    old, other = tmp_path / "v00000001", tmp_path / "v00000002"
    for folder in (old, other):
        folder.mkdir()
        for rank in range(2):
            (folder / f"rank{rank:05d}-of-00002.safetensors").write_bytes(b"state")
        (folder / ".rank00000-of-00002.safetensors.x1y2.tmp").write_bytes(b"torn")
    (other / "notes.txt").write_text("mine")
    _remove_version(old)
    _remove_version(other)
    assert not old.exists()
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


# -- the synthetic trainer's checkpoint -------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FleetModel:
    return FleetModel(small_fleet(tmp_path_factory.mktemp("fleet"), refits=3))


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


def test_a_checkpoint_resumes_and_replays_the_missing_steps(
    model: FleetModel, tmp_path: Path
) -> None:
    path = tmp_path / "trainer" / "o1.npz"
    _save_checkpoint(path, 1, model.run.shards(model.plan, 1, 1))
    found = _read_checkpoint(model, 1, 2, path)
    assert found is not None and found[0] == 1
    assert _same_bits(found[1], model.run.shards(model.plan, 1, 1))
    assert _same_bits(_resume(model, 1, 2, path), model.run.shards(model.plan, 1, 2))
    assert [p.name for p in path.parent.iterdir()] == ["o1.npz"]  # no temporary file left


def _foreign_npz(path: Path, model: FleetModel, rank: int, **change: object) -> None:
    """A checkpoint of this rank's keys with some fields changed (another run, layout)."""
    shards = model.run.shards(model.plan, rank, 1)
    keys = sorted(shards)
    arrays: dict[str, object] = {
        "version": np.array(1),
        "keys": np.array(keys),
        **{f"t{i}": bits(shards[k]).reshape(-1) for i, k in enumerate(keys)},
    }
    arrays.update(change)
    np.savez(path, **arrays)  # type: ignore[arg-type]


def test_an_unreadable_checkpoint_counts_as_absent(
    model: FleetModel, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Torn (cut at several lengths), garbage, or of another run or layout: the rank computes
    the committed version from scratch and says why, instead of raising (which would make
    the launcher restart the trainer forever)."""
    path = tmp_path / "o0.npz"
    _save_checkpoint(path, 2, model.run.shards(model.plan, 0, 2))
    whole = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    broken = {f"cut at {n}": whole[:n] for n in (0, 3, 30, len(whole) // 2, len(whole) - 1)}
    broken["garbage"] = np.random.default_rng(0).bytes(len(whole))
    broken["zip header then garbage"] = whole[:4] + b"\xff" * 200
    bare = tmp_path / "bare.npy"
    np.save(bare, np.arange(4))
    broken["a bare .npy array"] = bare.read_bytes()
    expected = model.run.shards(model.plan, 0, 2)
    for name, data in broken.items():
        path.write_bytes(data)
        assert _read_checkpoint(model, 0, 2, path) is None, name
        assert _same_bits(_resume(model, 0, 2, path), expected), name
    t0 = bits(model.run.shards(model.plan, 0, 1)[sorted(expected)[0]]).reshape(-1)
    foreign = {
        "another dtype": {"t0": t0.astype(np.uint64)},
        "another shape": {"t0": t0[:-1]},
        "a version that is no integer": {"version": np.array([1, 2])},
        "a later version": {"version": np.array(3)},
        "other keys": {"keys": np.array(["a", "b"])},
    }
    for name, change in foreign.items():
        _foreign_npz(path, model, 0, **change)
        assert _read_checkpoint(model, 0, 2, path) is None, name
        assert _same_bits(_resume(model, 0, 2, path), expected), name
    err = capfd.readouterr().err
    assert err.count(f"cannot resume from the checkpoint {path}") == 2 * (
        len(broken) + len(foreign)
    )
    assert "computing version 2 from scratch" in err
    path.unlink()  # no checkpoint at all: computed, nothing said
    assert _read_checkpoint(model, 0, 2, path) is None
    assert capfd.readouterr().err == ""


def test_the_checkpoint_is_fsynced_then_its_directory(
    model: FleetModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def record(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("directory" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", record)
    path = tmp_path / "trainer" / "o0.npz"
    _save_checkpoint(path, 1, model.run.shards(model.plan, 0, 1))
    assert synced == ["file", "directory"]
    found = _read_checkpoint(model, 0, 1, path)
    assert found is not None and found[0] == 1
