"""The Ray suite runs only inside a private network namespace that has loopback alone
(``make test-ray``: ``unshare -n``), because Ray binds every interface and talks to the
machine's own address; the top-level conftest leaves this directory out elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dcr.demo import demo_fleet_file
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.testing.netns import only_loopback
from dcr.testing.pids import wait_gone

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """A Ray cluster of four nodes on this machine: the head, a trainer node (four CPUs, the
    ``trainer`` resource) and two rollout nodes (``rollout``).  Shut down afterwards, with
    every raylet it started gone (checked by pid)."""
    assert only_loopback(), "run the Ray suite with `make test-ray` (a private network)"
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=4, resources={"trainer": 4})
    for _ in range(2):
        c.add_node(num_cpus=1, resources={"rollout": 1})
    try:
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
        yield c
    finally:
        pids = [
            p.process.pid
            for node in c.list_all_nodes()
            for infos in node.all_processes.values()
            for p in infos
        ]
        ray.shutdown()
        c.shutdown()
        wait_gone(pids)


def ray_fleet(
    tmp_path: Path, *, keys: bool = True, refits: int = 3, extra: str = ""
) -> FleetConfig:
    path = demo_fleet_file(
        tmp_path, size_mb=0, refits=refits, rate=0.05, model_overrides=TINY, chunk_mb=0.03125,
        bucket_mb=0.0625, keys=keys, extra=extra,
    )  # fmt: skip
    cfg = load_fleet(path)
    cfg.ensure_keys()
    return cfg
