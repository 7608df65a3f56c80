"""A Ray cluster of several nodes on this one machine, for ``dcr rl --backend ray``, ``dcr bench
refit --backend ray`` and tests: the head, trainer nodes and rollout nodes as separate raylets
told apart by custom resources (``[ray] trainer`` and ``rollout``), shut down afterwards with
every process it started gone (checked by pid).

Every node's worker processes run in process groups of their own that Ray kills with the
worker (``process_group_cleanup_enabled``): a killed vLLM engine actor takes its engine core
and workers with it, as a restarted one must not find them still holding its receivers.

Ray binds every interface and talks to the machine's own address: on a shared machine, start
it inside a private network namespace that has loopback alone (``unshare -n python -m
dcr.ray.netns ...``); :func:`local_cluster` says so when it is not in one.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.fleet.pids import wait_gone
from dcr.ray.fleet import require_ray
from dcr.ray.netns import only_loopback

__all__ = ["SYSTEM_CONFIG", "ClusterShape", "local_cluster"]

SYSTEM_CONFIG = {"process_group_cleanup_enabled": True}
"""Ray's settings for the clusters started here (see the module's docstring)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterShape:
    """The nodes of a local cluster: the head, one trainer node with ``trainer_cpus`` CPUs
    carrying ``trainer_cpus`` of ``trainer``, and ``rollout_nodes`` nodes with ``rollout_cpus``
    CPUs each carrying one ``rollout``."""

    trainer_cpus: int = 4
    rollout_nodes: int = 2
    rollout_cpus: int = 1
    head_cpus: int = 1
    trainer: str = "trainer"
    rollout: str = "rollout"
    metrics_ports: tuple[int, ...] = ()
    """Each node's Prometheus export port (head, trainer, rollout nodes in order; needs
    ``ray[default]``); empty: Ray's choice."""
    system_config: dict[str, Any] = field(default_factory=dict)
    """Ray settings beyond :data:`SYSTEM_CONFIG` (``metrics_report_interval_ms``, say)."""

    def node_args(self) -> list[dict[str, Any]]:
        """``Cluster.add_node`` arguments of every node, the head first."""
        nodes: list[dict[str, Any]] = [
            {"num_cpus": self.head_cpus,
             "_system_config": {**SYSTEM_CONFIG, **self.system_config}},
            {"num_cpus": self.trainer_cpus, "resources": {self.trainer: self.trainer_cpus}},
            *({"num_cpus": self.rollout_cpus, "resources": {self.rollout: 1}}
              for _ in range(self.rollout_nodes)),
        ]  # fmt: skip
        if self.metrics_ports:
            if len(self.metrics_ports) != len(nodes):
                raise ValueError(f"{len(nodes)} nodes need {len(nodes)} metrics ports")
            for node, port in zip(nodes, self.metrics_ports, strict=True):
                node["metrics_export_port"] = port
        return nodes


@contextlib.contextmanager
def local_cluster(
    shape: ClusterShape = ClusterShape(), *, say: Callable[[str], None] = lambda line: None
) -> Iterator[Any]:
    """Start the cluster ``shape`` on this machine and connect this process to it; yields the
    ``ray.cluster_utils.Cluster``.  Afterwards Ray is shut down and every raylet, GCS server
    and worker process the cluster started is gone."""
    # Ray's own warnings (no route to the internet to find this host's address, say) would
    # bury the run's output; its errors still show.  Read when Ray is first imported.
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    ray = require_ray(connected=False)
    from ray.cluster_utils import Cluster

    if not only_loopback():
        say("Ray listens on every interface of this machine: run it under `unshare -n python "
            "-m dcr.ray.netns ...` to keep it on loopback")  # fmt: skip
    if ray.is_initialized():
        ray.shutdown()
    head, *nodes = shape.node_args()
    cluster: Any = Cluster(initialize_head=True, head_node_args=head)
    try:
        for node in nodes:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        yield cluster
    finally:
        pids = [
            p.process.pid
            for node in cluster.list_all_nodes()
            for infos in node.all_processes.values()
            for p in infos
        ]
        workers = _children(pids)  # the raylets' workers, the user's actors among them
        ray.shutdown()
        cluster.shutdown()
        _kill_left(workers)  # a worker orphaned by its raylet's exit would live on
        wait_gone(pids + workers)


def _children(parents: list[int]) -> list[int]:
    """Live child processes of ``parents`` (from ``/proc``; empty where there is none)."""
    wanted = set(parents)
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) in wanted:
            out.append(int(entry.name))
    return out


def _kill_left(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` still alive after the cluster stopped, with its process group
    where it leads one (a worker's engine processes)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
