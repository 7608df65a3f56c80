"""A fleet of real processes on 127.0.0.1: every role is SIGKILLed mid-refit once, every
receiver stays bit-exact, versions stay contiguous, and nothing survives the launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import alive, small_fleet

from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.faults import Fault, default_faults
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel, digests
from dcr.fleet.relay import relay_config
from dcr.models.synthetic import SyntheticRun
from dcr.tensors.bits import bits


def committed_versions(run_dir: Path) -> list[tuple[int, int]]:
    """(base, record) of every transition that moved the record, from the coordinators."""
    moved = []
    for path in sorted((run_dir / "events").glob("coordinator*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "ended" and e["record"] > e["base"]:
                moved.append((e["t"], e["base"], e["record"]))
    return [(b, r) for _, b, r in sorted(moved)]


def test_every_role_killed_mid_refit_recovers_bit_exactly(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=5)
    plan = default_faults(cfg)
    assert [(f.version, f.target) for f in plan] == [
        (2, "r1"), (3, "o1"), (4, "coordinator"), (5, "relay-node1"),
    ]  # fmt: skip
    launcher = Launcher(cfg, faults=plan, deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    rows = report["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5]
    # Each planned SIGKILL struck mid-refit, in the refit it was planned for.
    killed = {(k["version"], k["process"].split("-")[0]) for k in report["sigkills"]}
    assert killed == {(2, "r1"), (3, "o1"), (4, "coordinator"), (5, "relay")}
    assert [r["killed"] for r in rows] == [[], ["receiver"], ["owner"], ["coordinator"], ["relay"]]
    # Every receiver was checked for every version, against a dense load computed here.
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] and r["bit_exact"] for r in rows)
    # A receiver killed after applying a payload forces an overwrite retry; the restarted
    # coordinator's standby takes over the attempt in flight in overwrite mode.
    assert rows[1]["attempts"][0] == "mixed" and rows[1]["attempts"][-1] == "overwrite"
    assert rows[3]["attempts"][-1] == "overwrite"
    # No version lost or committed twice: the record moved 0 -> 1 -> ... -> 5.
    assert committed_versions(cfg.run_dir) == [(v - 1, v) for v in range(1, 6)]
    # 11 processes, 7 planned restarts (r1, the 4 trainer ranks, a coordinator, a relay node).
    # A process that exits by itself is restarted too: once on a machine loaded three times
    # over (19 starts), the run bit-exact all the same; more would be a process failing again
    # and again.
    assert report["processes"] == 11 and 18 <= report["starts"] <= 20
    # Nothing survives: every process the launcher started is gone.
    pids = [p.popen.pid for p in launcher.procs.values() if p.popen is not None]
    assert pids and not [pid for pid in pids if alive(pid)]
    # The fleet ran with its keys: CURVE on every socket, every payload sealed and checked.
    assert cfg.keys is not None
    started = [e for e in events(cfg.run_dir) if e["event"] in ("started", "active")]
    by_role = {(e.get("role") or "coordinator") for e in started}
    assert by_role == {"owner", "receiver", "relay", "coordinator"}
    assert all(e["keyed"] for e in started), started
    assert all(e["sealed"] for e in started if e.get("role") in ("owner", "receiver"))


def events(run_dir: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_the_check_catches_a_single_flipped_bit(tmp_path: Path) -> None:
    """The launcher's verdict compares digests of every parameter's bits: one flipped bit in
    one rank's storage is a mismatch that fails the run."""
    cfg = small_fleet(tmp_path, refits=1)
    launcher = Launcher(cfg)
    model = FleetModel(cfg)
    state = model.run.state(1)
    loader = ShardedServingLoader.dense(model.config, model.family, state, tp_size=2, tp_rank=1)
    launcher._check("r2", 1, digests(loader.module))
    assert launcher.mismatches == [] and launcher.rows[1].checks == {"r2": True}
    w = loader.module.get_parameter("model.layers.1.mlp.down_proj.weight")
    bits(w.detach()).reshape(-1)[7] ^= 1
    launcher._check("r2", 1, digests(loader.module))
    assert launcher.rows[1].checks == {"r2": False} and launcher.mismatches
    assert "down_proj" in launcher.mismatches[0]


def test_a_missed_fault_moves_to_the_next_refit(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=3)
    launcher = Launcher(cfg, faults=[Fault(version=2, target="relay-node1")])
    launcher._committed = 2  # refit 2 finished before a receiver applied anything
    killed: list[tuple[str, int]] = []
    launcher.kill = lambda name, version, **_: killed.append((name, version))  # type: ignore[method-assign]
    (cfg.run_dir).mkdir(parents=True)
    launcher._advance_faults()
    planned = json.loads((cfg.run_dir / "faults.json").read_text())
    assert planned == [{"target": "relay-node1", "version": 3, "point": "applied"}]
    # A receiver of node1 stops after applying a payload of refit 3: its relay node dies.
    point = {"who": "r1", "event": "fault-point", "point": "applied", "version": 3}
    launcher._strike({**point, "target": "relay-node1"})
    assert killed == [("relay-node1", 3)] and launcher.faults == []


def _coordinator_events(cfg: FleetConfig) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((cfg.run_dir / "events").glob("coordinator*.jsonl"))
        for line in path.read_text().splitlines()
    ]


@pytest.mark.parametrize("away", ["restarted", "gone"])
def test_a_relay_node_killed_while_a_receiver_restores(tmp_path: Path, away: str) -> None:
    """A relay node dies while a receiver below it restores (its dense payloads go through
    the node).  Gone for longer than the tree's ``peer_timeout_s``, the payloads still on
    their way are delivered to nobody: the receiver's arrival check against the owners' sent
    lists fails the job (``missing``) within the transport's arrival grace, and the
    coordinator sends it again.  Restarted at once, the restore goes on through the new
    node; a payload the dead node held, or that the root sent it while it restarted, is
    lost the same way and the job is sent again (``missing``), else nothing fails.  Either
    way the receiver is restored and the next refit does not start without it."""
    # A queue of two payloads: while r1 waits at its fault point (its first dense payload
    # applied), the rest of its dense payloads are still on their way.
    cfg = small_fleet(tmp_path, refits=3, extra="[queue]\ngroups = 1\ngroup_size = 1\n")
    down_s = 0.0 if away == "restarted" else 2 * relay_config(cfg).peer_timeout_s
    plan = [
        Fault(version=2, target="r1"),
        Fault(version=2, target="relay-node1", after="dense", down_s=down_s),
    ]
    launcher = Launcher(cfg, faults=plan, deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [(k["version"], k["process"]) for k in report["sigkills"]] == [
        (2, "r1"), (2, "relay-node1"),
    ]  # fmt: skip
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] for r in report["refits"])
    events = _coordinator_events(cfg)
    # A job sent while the owners move their baselines fails "version" and is sent again.
    failed = [e for e in events if e["event"] == "dense-failed" and e["receiver"] == "r1"]
    checks = {e["check"] for e in failed}
    assert checks <= {"version", "missing"}, failed
    if away == "gone":
        assert "missing" in checks, failed
    restored = [e["version"] for e in events if e["event"] == "restored" and e["receiver"] == "r1"]
    assert restored[-1] == 2
    assert not [e for e in events if e["event"] == "not-waiting"]
    assert committed_versions(cfg.run_dir) == [(0, 1), (1, 2), (2, 3)]


def test_a_fleet_that_does_not_finish_says_where_it_stands(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=3)
    launcher = Launcher(cfg, deadline_s=5)
    launcher._on_event({"t": 0.0, "who": "coordinator", "event": "active", "epoch": 2})
    launcher._on_event({"t": 0.0, "who": "r1", "event": "applied", "attempt": 7})
    message = launcher._stalled()
    assert "within 5 s: version 0 of 3 committed, active coordinator coordinator" in message
    assert "r1: applied" in message and str(cfg.run_dir) in message


def test_a_restarted_trainer_rank_resumes_from_its_checkpoint_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank's checkpoint at the committed version, one behind it (killed before the write),
    or unusable (another layout, damaged): every way gives the shards of that version."""
    from dcr.fleet.owner import _checkpoint_path, _resume, _save_checkpoint

    cfg = small_fleet(tmp_path, refits=3)
    model = FleetModel(cfg)
    path = _checkpoint_path(cfg, 1)
    want = model.run.shards(model.plan, 1, 3)

    def same(got: dict) -> bool:  # type: ignore[type-arg]
        return got.keys() == want.keys() and all(
            (bits(got[k]) == bits(want[k])).all() for k in want
        )

    assert same(_resume(model, 1, 3, path))  # no checkpoint yet: computed from scratch
    behind = model.run.shards(model.plan, 1, 2)
    other = model.run.shards(model.plan, 0, 3)  # the other TP rank's shards
    assert other.keys() != want.keys()
    # The checkpoint is what is read: a bit flipped in it comes back.
    key = sorted(want)[0]
    marked = {k: t.clone() for k, t in want.items()}
    bits(marked[key]).reshape(-1)[0] ^= 1
    _save_checkpoint(path, 3, marked)
    first = bits(_resume(model, 1, 3, path)[key]).reshape(-1)[0]
    assert first == bits(marked[key]).reshape(-1)[0] != bits(want[key]).reshape(-1)[0]
    with monkeypatch.context() as m:  # from here on, recomputing from scratch is an error
        m.setattr(SyntheticRun, "shards", lambda *a: pytest.fail("recomputed from scratch"))
        _save_checkpoint(path, 3, want)
        assert same(_resume(model, 1, 3, path))
        _save_checkpoint(path, 2, behind)
        assert same(_resume(model, 1, 3, path))  # one step replayed
    _save_checkpoint(path, 3, other)
    assert same(_resume(model, 1, 3, path))
    path.write_bytes(b"not a checkpoint")
    assert same(_resume(model, 1, 3, path))


def test_a_flipped_bit_in_a_receiver_is_disproved_and_restored_bit_exactly(
    tmp_path: Path,
) -> None:
    """Applier r0 flips one stored bit right after it reported v1 (silent corruption, no
    process dies).  The fingerprint at the next prepare catches it: r0 is disproved and
    restored by dense refit, the retry waits for it and commits v2 with it, and every
    receiver ends bit-exact;
    the first transition fingerprinted every receiver (they all restored at start)."""
    extra = "\n[proof]\nfingerprint_each_commit = true\n"
    cfg = small_fleet(tmp_path, refits=3, extra=extra)
    assert cfg.proof is not None and cfg.proof.fingerprint_each_commit
    launcher = Launcher(cfg, faults=[Fault(version=1, target="r0", after="flip")], deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    rows = report["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] and r["bit_exact"] for r in rows)
    assert [r["disproved"] for r in rows] == [[], ["r0"], []]
    assert rows[1]["attempts"][0] == "mixed" and len(rows[1]["attempts"]) >= 2
    events = [
        json.loads(line)
        for path in sorted((cfg.run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    flipped = [e for e in events if e["event"] == "flipped"]
    assert [(e["who"], e["version"]) for e in flipped] == [("r0", 1)]
    proved = [e for e in events if e["event"] == "proved"]
    first = [e for e in proved if e["base"] == 0]
    assert first and first[0]["fingerprinted"] > 0 and first[0]["failed"] == []
    caught = [e for e in proved if e["base"] == 1 and e["failed"]]
    assert caught and caught[0]["failed"] == ["r0"] and caught[0]["fingerprinted"] > 0
    assert committed_versions(cfg.run_dir) == [(0, 1), (1, 2), (2, 3)]
    # The retry waited for r0's restore (join_wait_s): it took part in committing v2.
    [ended] = [e for e in events if e["event"] == "ended" and e["base"] == 1 and e["record"] == 2]
    assert ended["attempts"][0]["receivers"] == ["r0", "r1", "r2"]
    assert ended["attempts"][-1]["receivers"] == ["r0", "r1", "r2"]


def test_a_preloaded_receiver_holding_other_bits_is_fingerprinted_before_it_takes_part(
    tmp_path: Path,
) -> None:
    """Receivers that start holding version 0 (``[model] preloaded``, as an engine started
    from the first checkpoint does) claim the committed record without a dense refit.  r0
    flips one stored bit right after it loaded version 0, so it claims v0 with other bits.
    The first transition fingerprints every receiver, whatever it claims: r0 is disproved,
    restored by dense refit, and every receiver ends bit-exact; the proof would miss the bit
    with the seeded sample alone."""
    cfg = small_fleet(tmp_path, refits=2)
    text = cfg.path.read_text().replace("refits = 2\n", "refits = 2\npreloaded = true\n", 1)
    cfg.path.write_text(text)
    cfg = load_fleet(cfg.path)
    assert cfg.model.preloaded and cfg.proof is not None
    assert not cfg.proof.fingerprint_each_commit
    launcher = Launcher(cfg, faults=[Fault(version=0, target="r0", after="flip")], deadline_s=600)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    rows = report["refits"]
    assert [r["disproved"] for r in rows] == [["r0"], []]
    events = [
        json.loads(line)
        for path in sorted((cfg.run_dir / "events").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert [(e["who"], e["version"]) for e in events if e["event"] == "flipped"] == [("r0", 0)]
    # Every receiver preloaded version 0; only r0, once disproved, restored it.
    restored = [e["receiver"] for e in events if e["event"] == "restored" and e["version"] == 0]
    assert restored == ["r0"]
    first = [e for e in events if e["event"] == "proved" and e["base"] == 0]
    assert first[0]["fingerprinted"] > 0 and first[0]["failed"] == ["r0"]
    assert all(r["bit_exact"] for r in rows)
    assert committed_versions(cfg.run_dir) == [(0, 1), (1, 2)]
