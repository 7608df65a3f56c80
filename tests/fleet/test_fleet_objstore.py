"""A fleet of real processes over a real S3 server (SeaweedFS): payloads on the S3 transport,
the commit record on S3 conditional writes, a receiver SIGKILLed mid-refit.  Every receiver
stays bit-exact, versions stay contiguous, no relay process runs, dense-refit payloads are
cleaned up, and nothing survives the launcher."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from fleet_helpers import alive, small_fleet

from dcr.adapters.commit.s3 import S3CommitStore
from dcr.adapters.transport.s3 import S3Transport
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.faults import Fault, default_faults
from dcr.fleet.launcher import Launcher
from dcr.testing.s3servers import S3Endpoint, SeaweedServer


@pytest.fixture(scope="module")
def seaweed() -> Iterator[S3Endpoint]:
    with SeaweedServer() as server:
        yield server.endpoint


def s3_fleet(directory: Path, endpoint: S3Endpoint, *, refits: int) -> FleetConfig:
    """The small test fleet with its payloads and its commit record on ``endpoint``."""
    path = small_fleet(directory, refits=refits).path
    bucket = endpoint.create_bucket()
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    where = f'bucket = "{bucket}"\nprefix = "{prefix}"\nendpoint_url = "{endpoint.url}"\n'
    where += 'addressing_style = "path"\n'
    text = path.read_text()
    text = text.replace('[commit_store]\nkind = "sqlite"\npath = "commit.db"\n',
                        f'[commit_store]\nkind = "s3"\n{where}')  # fmt: skip
    text = text.replace('[transport]\nkind = "relay"\nfanout = 2\n',
                        f'[transport]\nkind = "s3"\n{where}poll_s = 0.05\n')  # fmt: skip
    assert text.count('kind = "s3"') == 2
    path.write_text(text)
    return load_fleet(path)


def committed_versions(run_dir: Path) -> list[tuple[int, int]]:
    moved = []
    for path in sorted((run_dir / "events").glob("coordinator*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "ended" and e["record"] > e["base"]:
                moved.append((e["t"], e["base"], e["record"]))
    return [(b, r) for _, b, r in sorted(moved)]


@pytest.mark.heavy
def test_fleet_over_s3_survives_a_killed_receiver(
    tmp_path: Path, seaweed: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in seaweed.environ().items():
        monkeypatch.setenv(k, v)  # the processes find the credentials in the AWS chain
    cfg = s3_fleet(tmp_path, seaweed, refits=3)
    assert [f.target for f in default_faults(cfg)] == ["r1", "o1"]  # no relay to kill
    launcher = Launcher(cfg, faults=[Fault(version=2, target="r1")], deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    rows = report["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] and r["bit_exact"] for r in rows)
    assert [(k["version"], k["process"]) for k in report["sigkills"]] == [(2, "r1")]
    assert rows[1]["killed"] == ["receiver"]
    assert rows[1]["attempts"][0] == "mixed" and rows[1]["attempts"][-1] == "overwrite"
    assert committed_versions(cfg.run_dir) == [(0, 1), (1, 2), (2, 3)]
    # No relay process ran; every process the launcher started is gone.
    assert not [name for name in launcher.procs if name.startswith("relay-")]
    pids = [p.popen.pid for p in launcher.procs.values() if p.popen is not None]
    assert pids and not [pid for pid in pids if alive(pid)]

    async def storage() -> tuple[int, set[str]]:
        store = S3CommitStore(**{k: v for k, v in cfg.commit_store.items() if k != "kind"})
        transport = S3Transport(**{k: v for k, v in cfg.transport.items() if k != "kind"})
        try:
            version = (await store.read()).record.version
            payloads = await transport.backend.list("payload/")
            return version, {o.key.split("/")[1] for o in payloads}
        finally:
            await store.close()
            await transport.aclose()

    version, attempts = anyio.run(storage)
    assert version == 3
    # Dense refits (three at start, one for the restarted r1) and the finished transitions
    # were cleaned up; at most the last attempt's cleanup was cut short by the stop.
    assert len(attempts) <= 1, attempts


def test_fleet_files_name_object_stores(tmp_path: Path) -> None:
    """The documented ``[transport]`` / ``[commit_store]`` sections load; a directory path is
    relative to the fleet file; unknown keys are refused."""
    import re

    from dcr.adapters.transport.directory import DirectoryTransport
    from dcr.errors import ConfigError
    from dcr.fleet.runtime import make_store, make_transport

    docs = (Path(__file__).resolve().parents[2] / "docs" / "fleet.md").read_text()
    section = docs.split("### Object storage instead of the relay tree", 1)[1]
    documented = re.search(r"```toml\n(.*?)```", section, re.S)
    assert documented is not None
    base = small_fleet(tmp_path, refits=1).path.read_text()
    base = base.replace('[commit_store]\nkind = "sqlite"\npath = "commit.db"\n', "")
    base = base.replace('[transport]\nkind = "relay"\nfanout = 2\n', "")
    path = tmp_path / "s3.toml"
    path.write_text(base + documented[1])
    cfg = load_fleet(path)
    transport, store = make_transport(cfg), make_store(cfg)
    assert isinstance(transport, S3Transport) and isinstance(store, S3CommitStore)
    assert transport.backend.describe() == "s3://rl-refit/policy-a"
    assert store.describe() == "s3://rl-refit/policy-a/commit.json"
    assert [f.target for f in default_faults(cfg)] == []  # one refit: nothing to strike

    path.write_text(base + '[transport]\nkind = "directory"\npath = "objects"\npoll_s = 0.5\n')
    directory = make_transport(load_fleet(path))
    assert isinstance(directory, DirectoryTransport)
    assert directory.path == tmp_path / "objects" and directory.config.poll_s == 0.5
    anyio.run(directory.aclose)
    path.write_text(base + '[transport]\nkind = "directory"\nfanout = 2\n')
    with pytest.raises(ConfigError):
        make_transport(load_fleet(path))
