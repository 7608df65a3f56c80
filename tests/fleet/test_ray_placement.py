"""``[ray]`` and the placement of a fleet's roles on a Ray cluster, decided from the nodes
as ``ray.nodes()`` reports them (no Ray needed): an impossible one names the resource."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import small_fleet

from dcr.errors import ConfigError
from dcr.fleet.config import load_fleet
from dcr.ray import plan


def _node(i: int, *, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": f"n{i}", "Alive": alive, "NodeManagerAddress": f"10.0.0.{i}",
            "Resources": {"CPU": 1.0, **resources}}  # fmt: skip


def test_rollout_nodes_go_one_each_to_nodes_carrying_the_rollout_resource(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1)
    nodes = [
        _node(0), _node(1, trainer=1, CPU=4), _node(3, rollout=1), _node(2, rollout=1),
        _node(4, rollout=1, alive=False),
    ]  # fmt: skip
    p = plan(cfg, nodes)
    assert p.rollout == {"node0": "n2", "node1": "n3"}  # node-id order, the dead one left out
    assert p.trainer == ("n1",) and p.ips["n2"] == "10.0.0.2"


@pytest.mark.parametrize(
    ("nodes", "names"),
    [
        ([_node(1, trainer=1, CPU=4), _node(2, rollout=1)], "'rollout'"),
        ([_node(1, CPU=4), _node(2, rollout=1), _node(3, rollout=1)], "'trainer'"),
        ([_node(1, trainer=1, CPU=2), _node(2, rollout=1), _node(3, rollout=1)], "CPU each"),
    ],
)
def test_a_placement_that_cannot_be_satisfied_names_the_resource(
    tmp_path: Path, nodes: list[dict[str, Any]], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        plan(small_fleet(tmp_path, refits=1), nodes)


def test_the_ray_section_is_checked(tmp_path: Path) -> None:
    cfg = small_fleet(tmp_path, refits=1, extra='[ray]\nrollout = "gpu"\ncoordinators = 3\n')
    assert (cfg.ray.rollout, cfg.ray.coordinators, cfg.ray.trainer) == ("gpu", 3, "trainer")
    path = cfg.path
    path.write_text(path.read_text().replace("coordinators = 3", "coordinators = 0"))
    with pytest.raises(ConfigError, match=r"\[ray\]"):
        load_fleet(path)
