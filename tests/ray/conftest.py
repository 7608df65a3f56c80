"""The Ray suite runs only inside a private network namespace that has loopback alone
(``make test-ray``: ``unshare -n``), because Ray binds every interface and talks to the
machine's own address; the top-level conftest leaves this directory out elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dcr.demo import demo_fleet_file
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.ray.cluster import ClusterShape, local_cluster
from dcr.ray.netns import only_loopback

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """A Ray cluster of four nodes on this machine: the head, a trainer node (four CPUs, the
    ``trainer`` resource) and two rollout nodes (``rollout``).  Shut down afterwards, with
    every raylet it started gone (checked by pid)."""
    assert only_loopback(), "run the Ray suite with `make test-ray` (a private network)"
    with local_cluster(ClusterShape()) as c:
        yield c


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
