"""``dcr rl --backend ray``: the delta fleet of ``dcr rl`` on a Ray cluster started here.

The cluster (:func:`dcr.ray.cluster.local_cluster`) has four nodes: the head, a trainer node
(the ``trainer`` resource) and two rollout nodes (``rollout``).  The run's fleet file puts the
relay tree's root on one rollout node and the vLLM engine (its workers the receivers) with its
relay node on the other; :class:`~dcr.ray.run.RayRun` starts the two FSDP2 trainer ranks,
the engine, the coordinators and the relay nodes as actors, so the delta refits cross from
the trainer node to the rollout nodes only over the relay tree (or S3).  The trainer finds the
engine through the fleet's directory actor, not a file.  ``--faults`` kills the engine actor
(Ray restarts it; its workers restore by dense refit) and a trainer rank (the whole trainer
group restarts at the committed version) with ``ray.kill`` mid-refit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from dcr.fleet.config import FleetConfig
from dcr.fleet.faults import Fault

__all__ = ["run_on_ray"]


def run_on_ray(
    cfg: FleetConfig,
    faults: Sequence[Fault],
    watch: Callable[[dict[str, Any]], None],
    before_stop: Callable[[], None],
    deadline_s: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Run the fleet ``cfg`` on a local Ray cluster; the fleet report, with ``ray_start_s``
    (the cluster's start-up seconds)."""
    from dcr.ray.cluster import ClusterShape, local_cluster
    from dcr.ray.run import RayRun

    start = time.monotonic()
    shape = ClusterShape(trainer_cpus=cfg.world_size, trainer=cfg.ray.trainer,
                         rollout=cfg.ray.rollout)  # fmt: skip
    with local_cluster(shape, say=say):
        started = time.monotonic() - start
        say(f"started a Ray cluster of {2 + shape.rollout_nodes} nodes in {started:.1f} s")
        run = RayRun(cfg, faults=faults, say=say, deadline_s=deadline_s, watch=watch)
        report = run.run(before_stop=before_stop)
    report["ray_start_s"] = round(started, 2)
    return report
