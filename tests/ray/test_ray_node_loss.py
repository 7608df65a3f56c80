"""A rollout node lost mid-run (its Ray node removed from the cluster): its relay node and
receivers go with it, and the fleet goes on committing on the nodes left, every receiver
that is left bit-exact at every version.  The worst case: the node goes mid-refit and the
active coordinator with it, so a standby takes over an attempt that binds the lost receivers
(it never heard from them) and must let them depart at once."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from conftest import ray_fleet

from dcr.fleet.faults import Fault
from dcr.ray import RayRun


def test_the_fleet_goes_on_without_a_lost_rollout_node(cluster: object, tmp_path: Path) -> None:
    import ray

    cfg = ray_fleet(tmp_path, refits=6)
    # The run reports the lost receivers to the coordinator, which lets them depart at once:
    # its own bound (a control connection gone for 10 minutes) would outlast the run's
    # deadline.  The coordinator waits 3 s for receivers still starting before a transition.
    cfg = dataclasses.replace(
        cfg,
        coordinator=dataclasses.replace(cfg.coordinator, join_wait_s=3.0, depart_after_s=600.0),
    )
    # The active coordinator stops at its first reply of refit 3 (the attempt binds every
    # receiver); the leaf's Ray node goes then, relay node and receivers too, and the
    # coordinator is killed there as if it had been on that node.
    faults = [Fault(version=3, target="coordinator", after="replied")]
    run = RayRun(cfg, faults=faults, deadline_s=500, say=print)
    leaf = cfg.rollout[-1]
    removed = threading.Event()

    def remove_mid_refit(e: dict[str, object]) -> None:
        if removed.is_set() or e.get("event") != "fault-point" or e.get("version") != 3:
            return
        assert run.fleet.placement is not None
        node_id = run.fleet.placement.rollout[leaf.name]
        node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)  # type: ignore[attr-defined]
        removed.set()
        cluster.remove_node(node)  # type: ignore[attr-defined]

    run.watch = remove_mid_refit
    report = run.run()
    lost = {r.name for r in leaf.receivers}
    assert removed.is_set() and set(report["lost"]) == lost
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["version"] for r in report["refits"]] == list(range(1, 7))
    kept = sorted({r.name for r in cfg.receivers} - lost)
    assert all(set(kept) <= set(r["receivers_checked"]) for r in report["refits"])
    assert report["refits"][-1]["receivers_checked"] == kept
    assert not ray.util.list_named_actors(all_namespaces=True)
    departed = set()
    for path in cfg.events_dir.glob("coordinator*"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "departed":
                departed.add(e["receiver"])
    assert departed == lost
