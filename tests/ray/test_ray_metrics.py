"""A fleet on Ray with ``[metrics] ray = true``: every role's actor reports through
``ray.util.metrics``, and each node's metrics agent exports them in the Prometheus text format
on its metrics export port (127.0.0.1 inside the test's network namespace), named
``ray_dcr_*`` with the labels ``fleet``, ``role`` and ``name``; the values are what the
roles' event files say."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ray_fleet
from prometheus_client.parser import text_string_to_metric_families

from dcr.fleet.config import FleetConfig
from dcr.ports import free_ports
from dcr.ray.cluster import ClusterShape, local_cluster
from dcr.ray.netns import only_loopback

EXPORT_WAIT_S = 90.0
"""How long the exported values may take to catch up with the events (Ray reports every
second here: ``metrics_report_interval_ms``)."""


@pytest.fixture(scope="module")
def exporting() -> Iterator[list[int]]:
    """The conftest's four-node cluster, each node exporting its metrics on a port of its own;
    yields the ports.  Shut down afterwards, every raylet it started gone (by pid)."""
    assert only_loopback(), "run the Ray suite with `make test-ray` (a private network)"
    ports = free_ports(4)
    shape = ClusterShape(metrics_ports=tuple(ports),
                         system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    with local_cluster(shape):
        yield ports


Sample = tuple[str, dict[str, str], float]


def scrape_all(ports: list[int]) -> tuple[list[Sample], str]:
    """Every ``dcr`` sample the nodes export now, and the text they came in."""
    samples: list[Sample] = []
    texts = []
    for port in ports:
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
        except OSError:
            continue  # a node's agent still starting
        texts.append(text)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_dcr_"):
                    samples.append((s.name, dict(s.labels), float(s.value)))
    return samples, "\n".join(texts)


def pick(samples: list[Sample], sample: str, /, **labels: str) -> list[float]:
    return [v for n, ls, v in samples if n == sample and labels.items() <= ls.items()]


def events(cfg: FleetConfig, who: str) -> list[dict[str, Any]]:
    path = cfg.events_dir / f"{who}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_roles_in_ray_actors_export_their_metrics_through_ray(
    exporting: list[int], tmp_path: Path
) -> None:
    from dcr.ray import RayRun

    cfg = ray_fleet(tmp_path, refits=2, extra="\n[metrics]\nray = true\n")
    assert cfg.metrics.ray and not cfg.metrics.port
    report = RayRun(cfg, deadline_s=300, say=print).run()
    assert report["bit_exact"] is True, report["mismatches"]

    # What each role's events say (no faults: one process per role).
    (active,) = {
        who
        for who in ["coordinator", *(f"coordinator-{i}" for i in range(1, cfg.ray.coordinators))]
        if (cfg.events_dir / f"{who}.jsonl").exists()
        and any(e["event"] == "ended" for e in events(cfg, who))
    }
    ended = [e for e in events(cfg, active) if e["event"] == "ended"]
    committed = sum(e["outcome"] == "committed" for e in ended)
    sent = {o: sum(e["size"] for e in events(cfg, o) if e["event"] == "sent") for o in cfg.owners}
    applied = {
        r.name: sum(e["event"] == "applied" for e in events(cfg, r.name)) for r in cfg.receivers
    }
    want: list[tuple[str, dict[str, str], float]] = [
        ("ray_dcr_refits_total", {"name": active, "outcome": "committed"}, committed),
        ("ray_dcr_committed_version", {"name": active, "role": "coordinator"}, 2),
        ("ray_dcr_refit_attempts_count", {"name": active}, committed),
        ("ray_dcr_refit_phase_seconds_count", {"name": active, "phase": "refit"}, committed),
        *(("ray_dcr_payload_bytes_total", {"name": o, "role": "owner"}, b)
          for o, b in sent.items()),
        *(("ray_dcr_committed_version", {"name": o, "role": "owner"}, 2) for o in cfg.owners),
        *(("ray_dcr_payloads_applied_total", {"name": r}, n) for r, n in applied.items()),
        *(("ray_dcr_committed_version", {"name": r, "role": "receiver"}, 2) for r in applied),
    ]  # fmt: skip
    assert committed == 2 and all(sent.values()) and all(applied.values())

    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        samples, text = scrape_all(exporting)
        got = [pick(samples, name, fleet="demo", **labels) for name, labels, _ in want]
        if all(g == [v] for g, (_, _, v) in zip(got, want, strict=True)):
            break
        missing = [(w, g) for w, g in zip(want, got, strict=True) if g != [w[2]]]
        assert time.monotonic() < deadline, f"not exported as the events say: {missing}"
        time.sleep(1.0)
    # The V_cross the relay root counted and the receivers' gate, exported too.
    assert pick(samples, "ray_dcr_cross_bytes_total", name="relay-node0", role="relay")
    assert pick(samples, "ray_dcr_gate_closed_seconds_count", role="receiver")
    sample_lines = [line for line in text.splitlines() if line.startswith("ray_dcr_refits_total")]
    print("\n".join(sample_lines))
