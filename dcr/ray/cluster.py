"""A Ray cluster of several nodes on this one machine, for ``dcr rl --backend ray``, ``dcr bench
refit --backend ray`` and tests: the head, trainer nodes and rollout nodes as separate raylets
told apart by custom resources (``[ray] trainer`` and ``rollout``), shut down afterwards with
every process it started gone (checked by pid).  Every process of the cluster, down to those an
actor starts in sessions of its own, carries a mark in its environment (``DCR_RAY_CLUSTER``);
those still alive once Ray stopped (orphaned when their parent died first) are SIGKILLed.

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
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcr.fleet.pids import alive, wait_gone
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
    mark = f"{_MARK}={secrets.token_hex(8)}"
    with _marked(mark):  # every process of the cluster, and every one they start, carries it
        cluster: Any = Cluster(initialize_head=True, head_node_args=head)
    try:
        with _marked(mark):
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
        ray.shutdown()
        cluster.shutdown()
        # A process whose parent died first lives on: a worker orphaned by its raylet's exit,
        # or the engine processes of an actor killed just before the raylet stopped.
        wait_gone(pids + _kill_marked(mark))


_MARK = "DCR_RAY_CLUSTER"
"""The environment variable that marks the processes of one :func:`local_cluster`."""


@contextlib.contextmanager
def _marked(mark: str) -> Iterator[None]:
    """Processes started inside carry ``mark`` (``NAME=value``) in their environment, and hand
    it down to theirs: Ray's raylets start their workers with their own environment."""
    name, value = mark.split("=", 1)
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _marked_pids(mark: str) -> list[int]:
    """Live processes other than this one whose environment, as they started, holds ``mark``."""
    needle = mark.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _kill_marked(mark: str, rounds: int = 5) -> list[int]:
    """SIGKILL every process that carries ``mark`` until none is left alive (a process may
    start another between a scan and its kill); returns the pids killed."""
    killed: set[int] = set()
    for _ in range(rounds):
        left = _marked_pids(mark)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed.update(left)
        time.sleep(0.1)  # (a process just killed is still listed until the kernel reaps it)
    return sorted(killed)
