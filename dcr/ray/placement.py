"""Where a fleet's roles go on a Ray cluster, decided before anything starts.

:func:`plan` reads the cluster's nodes as ``ray.nodes()`` reports them and the fleet's
``[ray]`` section: each ``[[rollout]]`` node of the fleet goes to its own alive Ray node that
carries the ``rollout`` resource, and the trainer ranks need the ``trainer`` resource and a
CPU each.  A placement that cannot be satisfied is a :class:`~dcr.errors.ConfigError` naming
the resource, raised before any actor exists.  No Ray import here: the plan is plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig

__all__ = ["Placement", "plan"]


@dataclass(frozen=True, slots=True)
class Placement:
    """The Ray nodes a fleet's roles are pinned to."""

    rollout: dict[str, str]
    """Fleet rollout node -> the Ray node id its relay node and receivers run on."""
    trainer: tuple[str, ...]
    """Ray node ids carrying the trainer resource (trainer ranks go there)."""
    ips: dict[str, str]
    """Ray node id -> its IP address (where a relay node binds)."""


def plan(cfg: FleetConfig, nodes: Sequence[Mapping[str, Any]]) -> Placement:
    """The placement of ``cfg``'s roles on the cluster whose nodes are ``nodes``."""
    ray = cfg.ray
    alive = [n for n in nodes if n.get("Alive", False)]

    def carrying(resource: str) -> list[Mapping[str, Any]]:
        return sorted(
            (n for n in alive if float(n.get("Resources", {}).get(resource, 0)) > 0),
            key=lambda n: str(n["NodeID"]),
        )

    rollout = carrying(ray.rollout)
    wanted = [n.name for n in cfg.rollout]
    if len(rollout) < len(wanted):
        raise ConfigError(
            f"the fleet has {len(wanted)} rollout nodes ({', '.join(wanted)}) but "
            f"{len(rollout)} alive Ray nodes carry the resource {ray.rollout!r} ([ray] "
            f"rollout): start each rollout node with `ray start --resources "
            f"'{{\"{ray.rollout}\": 1}}'`"
        )
    trainer = carrying(ray.trainer)
    ranks = len(cfg.owners)
    if ranks and not trainer:
        raise ConfigError(
            f"no alive Ray node carries the resource {ray.trainer!r} ([ray] trainer) for the "
            f"fleet's {ranks} trainer ranks"
        )
    cpus = sum(float(n.get("Resources", {}).get("CPU", 0)) for n in trainer)
    if cpus < ranks:
        raise ConfigError(
            f"the fleet's {ranks} trainer ranks need a CPU each on nodes carrying "
            f"{ray.trainer!r}; those nodes have {cpus:g}"
        )
    return Placement(
        rollout={name: str(n["NodeID"]) for name, n in zip(wanted, rollout, strict=False)},
        trainer=tuple(str(n["NodeID"]) for n in trainer),
        ips={str(n["NodeID"]): str(n.get("NodeManagerAddress", "127.0.0.1")) for n in alive},
    )
