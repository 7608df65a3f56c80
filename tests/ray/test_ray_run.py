"""A whole fleet on Ray -- coordinators, relay tree, receivers and trainer ranks as actors on
a four-node cluster -- refitting ten times while every role's actor is killed mid-refit:
every receiver bit-exact at every version, versions contiguous, no actor left behind."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from conftest import ray_fleet

from dcr.fleet.faults import default_faults
from dcr.ray import RayRun


def test_ten_refits_on_ray_with_actor_kills_of_every_role(cluster: object, tmp_path: Path) -> None:
    import ray

    cfg = ray_fleet(tmp_path, refits=10)
    plan = default_faults(cfg)
    run = RayRun(cfg, faults=plan, deadline_s=900, say=print)
    report = run.run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["version"] for r in report["refits"]] == list(range(1, 11))
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] for r in report["refits"])
    killed = Counter(
        "relay" if k["process"].startswith("relay-") else k["process"].rstrip("0123456789-")
        for k in report["sigkills"]
    )
    assert set(killed) == {"r", "o", "coordinator", "relay"}, killed
    assert len(report["sigkills"]) == len(plan)
    assert not ray.util.list_named_actors(all_namespaces=True)
