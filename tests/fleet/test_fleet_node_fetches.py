"""Object storage with two receiver processes on one rollout node: the node downloads each
payload once (the processes share their fetches through ``<run_dir>/fetches/<node>``), and
every receiver stays bit-exact."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import anyio
from fleet_helpers import small_fleet

from dcr.fleet.config import load_fleet
from dcr.fleet.launcher import Launcher
from dcr.fleet.runtime import make_transport


def test_receivers_of_one_node_download_each_payload_once(tmp_path: Path) -> None:
    path = small_fleet(tmp_path, refits=2).path
    text = path.read_text()
    assert '[transport]\nkind = "relay"\nfanout = 2\n' in text
    relay = '[transport]\nkind = "relay"\nfanout = 2\n'
    path.write_text(text.replace(relay, '[transport]\nkind = "directory"\npoll_s = 0.05\n'))
    cfg = load_fleet(path)
    shared = [n for n in cfg.rollout if len(n.receivers) > 1]
    single = [n for n in cfg.rollout if len(n.receivers) == 1]
    assert shared and single, "the small fleet has a node with several receivers and one without"

    report = Launcher(cfg, deadline_s=600).run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["version"] for r in report["refits"]] == [1, 2]

    # Every payload GET that crossed into a node, per node: one per object on the shared
    # node as on the single-receiver node.
    fetched: dict[str, list[str]] = defaultdict(list)
    for node in cfg.rollout:
        for r in node.receivers:
            for line in (cfg.events_dir / f"{r.name}.jsonl").read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "fetched":
                    fetched[node.name].append(e["key"])
    ours = sorted(fetched[shared[0].name])
    theirs = sorted(fetched[single[0].name])
    # The refits' payloads go to every node: the shared node fetched each once, not once per
    # receiver process (dense refits at start may address single receivers).
    common = sorted(set(ours) & set(theirs))
    assert common, (ours, theirs)
    assert all(ours.count(x) == theirs.count(x) == 1 for x in common), (ours, theirs)
    # Copies of cleaned-up attempts were dropped: at most the last attempts' copies remain.
    left = list((cfg.run_dir / "fetches" / shared[0].name).iterdir())
    assert len(left) < len(set(ours)), (len(left), len(set(ours)))
    assert not (cfg.run_dir / "fetches" / single[0].name).exists()


def test_node_cache_settings(tmp_path: Path) -> None:
    path = small_fleet(tmp_path, refits=1).path
    relay = '[transport]\nkind = "relay"\nfanout = 2\n'
    text = path.read_text().replace(relay, '[transport]\nkind = "directory"\nnode_cache = "nc"\n')
    path.write_text(text)
    cfg = load_fleet(path)
    for node in cfg.rollout:
        t = make_transport(cfg, node=node.name)
        assert t.config.node_cache == str(tmp_path / "nc" / node.name)  # type: ignore[attr-defined]
        anyio.run(t.aclose)
    owner_side = make_transport(cfg)
    assert owner_side.config.node_cache is None  # type: ignore[attr-defined]
    anyio.run(owner_side.aclose)
