"""``local_cluster`` leaves no process behind: not the raylets' workers, and not the processes
an actor started in sessions of their own, orphaned when the actor dies just before the cluster
stops (a vLLM engine actor's engine core and workers).  Processes the driver starts itself are
not the cluster's and are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dcr.fleet.pids import alive, wait_gone
from dcr.ray.cluster import ClusterShape, local_cluster

_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_processes_an_actor_started_in_their_own_sessions_are_gone_with_the_cluster() -> None:
    import ray

    @ray.remote(num_cpus=1)
    class Spawner:
        def spawn(self) -> tuple[int, int, int]:
            child = subprocess.Popen(
                [sys.executable, "-c", _GRANDCHILD], stdout=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
            assert child.stdout is not None
            grandchild = int(child.stdout.readline())
            return os.getpid(), child.pid, grandchild

    with local_cluster(ClusterShape(trainer_cpus=1, rollout_nodes=1)):
        actor = Spawner.remote()  # type: ignore[attr-defined]
        pids = ray.get(actor.spawn.remote(), timeout=120)
        assert all(alive(p) for p in pids)
        # The driver's own process, started inside the cluster's lifetime, is not the cluster's.
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        ray.kill(actor, no_restart=True)  # its processes are orphaned as the cluster stops
    try:
        assert [p for p in pids if alive(p)] == []
        assert own.poll() is None, "a process the driver started was killed with the cluster"
        assert "DCR_RAY_CLUSTER" not in os.environ
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        own.kill()
        own.wait(timeout=60)
        wait_gone(list(pids))
