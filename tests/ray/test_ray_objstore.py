"""A fleet on Ray over object storage -- a directory, and S3 on a SeaweedFS server -- instead
of the relay tree: no relay node is started, a receiver actor killed mid-refit is restarted by
Ray and restored, and every receiver is bit-exact at every version.

The cluster is this module's own: its raylets start after the S3 server, with the server's
credentials in their environment, as every actor of a real deployment gets them from its
node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ray_fleet

from dcr.adapters.s3server import SeaweedServer
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.faults import Fault
from dcr.ray import RayRun
from dcr.ray.cluster import ClusterShape, local_cluster
from dcr.ray.netns import only_loopback

RELAY = '[transport]\nkind = "relay"\nfanout = 2\n'


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The S3 server and a bucket; the module's cluster, started with its credentials."""
    assert only_loopback(), "run the Ray suite with `make test-ray` (a private network)"
    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        bucket = server.endpoint.create_bucket("dcr-ray")
        with pytest.MonkeyPatch.context() as env:
            for k, v in server.endpoint.environ().items():
                env.setenv(k, v)
            with local_cluster(ClusterShape()):
                yield {"bucket": bucket, "endpoint_url": server.endpoint.url}


def _over(cfg: FleetConfig, transport: str) -> FleetConfig:
    """``cfg``'s fleet file with ``transport`` instead of the relay tree."""
    text = cfg.path.read_text()
    assert RELAY in text
    cfg.path.write_text(text.replace(RELAY, transport))
    return load_fleet(cfg.path)


@pytest.mark.parametrize("kind", ["directory", "s3"])
def test_a_fleet_on_ray_over_object_storage(s3: dict[str, str], tmp_path: Path, kind: str) -> None:
    import ray

    if kind == "directory":
        transport = f'[transport]\nkind = "directory"\npath = "{tmp_path / "objects"}"\n'
    else:
        transport = (
            f'[transport]\nkind = "s3"\nbucket = "{s3["bucket"]}"\nprefix = "{tmp_path.name}"\n'
            f'endpoint_url = "{s3["endpoint_url"]}"\naddressing_style = "path"\n'
        )
    cfg = _over(ray_fleet(tmp_path, refits=4), transport)
    run = RayRun(cfg, faults=[Fault(version=2, target="r1", after="applied")], deadline_s=600)
    report = run.run()
    assert report["bit_exact"] is True, report["mismatches"]
    assert [r["version"] for r in report["refits"]] == [1, 2, 3, 4]
    assert all(r["receivers_checked"] == ["r0", "r1", "r2"] for r in report["refits"])
    assert [k["process"] for k in report["sigkills"]] == ["r1"]
    assert run.fleet.addresses == {} and not list(cfg.events_dir.glob("relay-*"))
    assert not ray.util.list_named_actors(all_namespaces=True)
