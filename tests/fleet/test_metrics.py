"""Per-refit metrics (dcr.metrics) over prometheus_client, scraped over HTTP on 127.0.0.1.

A real fleet of processes runs three refits with ``[metrics] port`` set (a receiver is
SIGKILLed mid-refit 2, so that the metrics see a retry, a restart and a dense restore); each
role's endpoint is scraped while the fleet runs, right after the events that change it, and
every value is checked against what that process's event file says.  The same events
replayed into a fresh registry give the same exposition; constructed sequences (exactly as
the roles emit them) cover what a short run does not: failed transitions, object-storage
fetches, the RL loop's staleness, the relay root's repeated reports."""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fleet_helpers import small_fleet
from prometheus_client.parser import text_string_to_metric_families

from dcr import metrics as dm
from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.eventlog import EventLog, add_listener, metrics_ports, remove_listener
from dcr.fleet.faults import Fault
from dcr.fleet.launcher import Launcher
from dcr.fleet.model import FleetModel

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

TRIGGERS = {"ended", "committed", "traffic", "state"}
"""Events after which the launcher's watcher scrapes the process that wrote them (and a
receiver's ``gate`` reopening)."""


# -- helpers ----------------------------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return str(r.read().decode())


def parse(text: str) -> Samples:
    """Every sample of an exposition but the ``_created`` timestamps."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out


def value(samples: Samples, sample: str, /, **labels: str) -> float:
    """The one sample called ``sample`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == sample and set(labels.items()) <= ls]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}


def contiguous_ports(n: int) -> int:
    """A first port of ``n`` consecutive ports nothing listens on now (bounded tries)."""
    for base in range(24100, 60000, 97)[:200]:
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


def incarnation(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the process's last incarnation (a restart starts a new registry)."""
    starts = [i for i, e in enumerate(events) if e["event"] in ("started", "standby")]
    return events[starts[-1] :] if starts else events


def replay(events: list[dict[str, Any]], role: str, name: str, *, elements: int | None) -> str:
    """``events`` fed to a fresh registry served on 127.0.0.1, scraped over HTTP."""
    backend = dm.PrometheusBackend()
    backend.serve("127.0.0.1", 0)
    m = dm.Metrics(backend)
    try:
        m.add(fleet="demo", role=role, name=name, elements=elements)
        for e in events:
            m.on_event(e)
        assert m.errors == 0
        assert backend.address is not None
        return scrape(backend.address)
    finally:
        m.close()


def file_events(cfg: FleetConfig, who: str) -> list[dict[str, Any]]:
    path = cfg.events_dir / f"{who}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


ROLES = {"relay-node0": "relay", "r0": "receiver", "r1": "receiver", "r2": "receiver",
         "o0": "owner", "o3": "owner"}  # fmt: skip
"""Processes whose scrapes are checked, besides the active coordinator."""


# -- a real fleet -----------------------------------------------------------------------------


class Run:
    def __init__(self, cfg: FleetConfig, report: dict[str, Any]) -> None:
        self.cfg = cfg
        self.report = report
        self.seen: dict[str, list[dict[str, Any]]] = {}
        """Process -> its events as the launcher's watcher saw them."""
        self.scraped: dict[str, tuple[int, str]] = {}
        """Process -> (its events seen when it was last scraped, the exposition)."""
        self.elements = sum(s.numel for s in FleetModel(cfg).catalog.values())

    @property
    def active(self) -> str:
        """The coordinator that ran the refits (whichever claimed the lease first)."""
        (active,) = {e["who"] for es in self.seen.values() for e in es if e["event"] == "ended"}
        return str(active)

    @property
    def roles(self) -> dict[str, str]:
        return {self.active: "coordinator", **ROLES}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("metrics-fleet")
    probe = small_fleet(tmp, refits=3)
    base = contiguous_ports(len(metrics_ports(_with_port(probe, 1))))
    cfg = small_fleet(tmp, refits=3, extra=f"\n[metrics]\nport = {base}\n")
    ports = metrics_ports(cfg)
    seen: dict[str, list[dict[str, Any]]] = {}
    scraped: dict[str, tuple[int, str]] = {}

    def watch(e: dict[str, Any]) -> None:
        who = e["who"]
        seen.setdefault(who, []).append(e)
        reopened = e["event"] == "gate" and e.get("state") == "open"
        if who in ports and (e["event"] in TRIGGERS or reopened):
            scraped[who] = (len(seen[who]), scrape(f"http://127.0.0.1:{ports[who]}/metrics"))

    launcher = Launcher(cfg, faults=[Fault(version=2, target="r1")], watch=watch, deadline_s=300)
    report = launcher.run()
    assert report["bit_exact"] is True, report["mismatches"]
    out = Run(cfg, report)
    out.seen, out.scraped = seen, scraped
    return out


def _with_port(cfg: FleetConfig, port: int) -> FleetConfig:
    import dataclasses

    return dataclasses.replace(cfg, metrics=dataclasses.replace(cfg.metrics, port=port))


def test_a_running_fleet_serves_its_metrics_on_127_0_0_1(run: Run) -> None:
    rows = run.report["refits"]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert rows[1]["attempts"][0] == "mixed" and rows[1]["attempts"][-1] == "overwrite"
    ports = metrics_ports(run.cfg)
    assert set(run.roles) <= set(run.scraped) <= set(ports)
    for who in run.scraped:  # each process said where it serves
        log = (run.cfg.run_dir / "logs" / f"{who}.log").read_text()
        assert f"serving metrics at http://127.0.0.1:{ports[who]}/metrics" in log


def test_the_coordinator_metrics_are_what_its_events_say(run: Run) -> None:
    n, text = run.scraped[run.active]
    events = incarnation(run.seen[run.active][:n])
    s = parse(text)
    ended = [e for e in events if e["event"] == "ended"]
    assert ended and ended[-1]["record"] == 3  # scraped after the last refit's commit
    committed = [e for e in ended if e["outcome"] == "committed"]
    for outcome in {e["outcome"] for e in ended}:
        count = sum(e["outcome"] == outcome for e in ended)
        assert value(s, "dcr_refits_total", outcome=outcome) == count
    modes = [a["mode"] for e in ended for a in e["attempts"]]
    assert value(s, "dcr_attempts_total", mode="overwrite") == modes.count("overwrite") >= 1
    assert value(s, "dcr_attempts_total", mode="mixed") == modes.count("mixed")
    failed = sum(len(e["attempts"]) - (e["record"] > e["base"]) for e in ended)
    assert value(s, "dcr_attempt_failures_total") == failed >= 1
    assert value(s, "dcr_refit_attempts_count") == len(committed) == 3
    assert value(s, "dcr_refit_attempts_sum") == sum(len(e["attempts"]) for e in committed)
    assert value(s, "dcr_refit_attempts_bucket", le="1.0") == sum(
        len(e["attempts"]) == 1 for e in committed
    )
    assert value(s, "dcr_refit_phase_seconds_count", phase="refit") == 3
    assert value(s, "dcr_refit_phase_seconds_sum", phase="refit") == pytest.approx(
        sum(e["seconds"] for e in committed)
    )
    assert value(s, "dcr_committed_version") == 3
    assert value(s, "dcr_coordinator_active") == 1
    for outcome, kind in (("started", "dense"), ("restored", "restored")):
        count = sum(e["event"] == kind for e in events)
        assert value(s, "dcr_dense_refits_total", outcome=outcome) == count >= 4
    restarts = sum(e["event"] == "restarted" for e in events)
    assert value(s, "dcr_endpoint_restarts_total") == restarts >= 1
    for r in ("r0", "r1", "r2"):  # all three took part in the last commit
        assert value(s, "dcr_staleness_versions", receiver=r) == 0
    assert r"dcr_refit_failures_total" not in names(s) or value(s, "dcr_refit_failures_total") == 0


def test_owner_metrics_are_what_its_events_say(run: Run) -> None:
    for who in ("o0", "o3"):
        n, text = run.scraped[who]
        events = incarnation(run.seen[who][:n])
        s = parse(text)
        sent = [e for e in events if e["event"] == "sent"]
        committed = [e for e in events if e["event"] == "committed"]
        last = committed[-1]
        assert last["version"] == 3
        assert value(s, "dcr_payloads_total") == len(sent)
        assert value(s, "dcr_payload_bytes_total") == sum(e["size"] for e in sent)
        assert value(s, "dcr_refit_payload_bytes") == last["payload_bytes"] > 0
        assert value(s, "dcr_refit_changed_elements") == last["changed_elements"] > 0
        assert value(s, "dcr_refit_change_ratio") == pytest.approx(
            last["changed_elements"] / run.elements
        )
        assert value(s, "dcr_committed_version") == 3
        for phase in ("publish", "stage", "construct", "transport", "baseline"):
            assert value(s, "dcr_refit_phase_seconds_count", phase=phase) == len(committed)
        assert value(s, "dcr_refit_phase_seconds_sum", phase="publish") == pytest.approx(
            sum(e["seconds"] for e in committed)
        )
        assert value(s, "dcr_refit_phase_seconds_sum", phase="baseline") == pytest.approx(
            sum(e["end"] - e["start"] for e in events if e["event"] == "baseline")
        )
    # Summed over owners, the change ratio is the fleet's change rate of the last refit.
    changed = 0.0
    for who in run.cfg.owners:
        committed = [e for e in file_events(run.cfg, who) if e["event"] == "committed"]
        changed += committed[-1]["changed_elements"]
    assert 0 < changed / run.elements < 1


def test_receiver_metrics_are_what_its_events_say(run: Run) -> None:
    for who in ("r0", "r1", "r2"):
        n, text = run.scraped[who]
        events = incarnation(run.seen[who][:n])
        s = parse(text)
        holds = [e for e in events if e["event"] == "holds"]
        assert holds[-1]["version"] == 3
        assert value(s, "dcr_committed_version") == 3
        applied = [e for e in events if e["event"] == "applied"]
        assert value(s, "dcr_payloads_applied_total") == len(applied) > 0
        opened = [e for e in events if e["event"] == "gate" and e["state"] == "open"]
        closed_s = [e["closed_s"] for e in opened if e["closed_s"] is not None]
        assert value(s, "dcr_gate_closed_seconds_count") == len(closed_s) >= 1
        assert value(s, "dcr_gate_closed_seconds_sum") == pytest.approx(sum(closed_s))
        cycles = _gate_cycles(events)
        assert value(s, "dcr_refit_phase_seconds_count", phase="apply") == len(cycles)
        assert value(s, "dcr_refit_phase_seconds_sum", phase="apply") == pytest.approx(
            sum(last - closed for closed, last, _ in cycles)
        )
        assert value(s, "dcr_refit_phase_seconds_sum", phase="commit") == pytest.approx(
            sum(opened_t - last for _, last, opened_t in cycles)
        )
    # r1 was killed mid-refit 2: its new process counts from its restart on.
    assert sum(e["event"] == "started" for e in file_events(run.cfg, "r1")) == 2


def _gate_cycles(events: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(gate closed, last payload applied, gate reopened) of every gate cycle that applied
    payloads."""
    out, closed, last = [], None, None
    for e in events:
        if e["event"] == "gate" and e["state"] == "closed" and closed is None:
            closed, last = e["t"], None
        elif e["event"] == "applied" and closed is not None:
            last = e["t"]
        elif e["event"] == "gate" and e["state"] == "open":
            if closed is not None and last is not None:
                out.append((closed, last, e["t"]))
            closed = last = None
    return out


def test_the_relay_root_counts_what_crossed_into_the_rollout_side(run: Run) -> None:
    n, text = run.scraped["relay-node0"]
    events = incarnation(run.seen["relay-node0"][:n])
    latest: dict[str, int] = {}
    for e in events:
        if e["event"] == "traffic":
            latest.update({a: c for a, (c, _) in e["attempts"].items()})
    s = parse(text)
    assert value(s, "dcr_cross_bytes_total") == sum(latest.values()) > 0
    # On the relay tree every attempt's V_cross is what its owners sent (V_payload).
    sent: dict[str, int] = {}
    for owner in run.cfg.owners:
        for e in file_events(run.cfg, owner):
            if e["event"] == "sent":
                sent[str(e["attempt"])] = sent.get(str(e["attempt"]), 0) + e["size"]
    assert sent and all(latest.get(a) == size for a, size in sent.items())


def test_replayed_events_give_the_same_exposition(run: Run) -> None:
    """Each process's events, replayed into a fresh registry, give exactly the samples its
    own endpoint served (up to an event it wrote between the watcher's read and its scrape)."""
    every: set[str] = set()
    for who, role in run.roles.items():
        n, text = run.scraped[who]
        live = parse(text)
        every |= names(live)
        events = file_events(run.cfg, who)
        start = len(events) - len(incarnation(events))
        elements = run.elements if role == "owner" else None
        replays = []
        for k in range(n, min(len(events), n + 3) + 1):  # bounded: the scrape's own moment
            replays.append(parse(replay(events[start:k], role, who, elements=elements)))
            if replays[-1] == live:
                break
        assert live in replays, who
    wanted = set(dm.METRICS) - {
        "dcr_refit_failures_total",
        "dcr_disproved_total",
        "dcr_rollout_staleness_versions",
    }  # fmt: skip  (a fault-free run of the synthetic trainer on the relay tree has none)
    exposed = {n.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket") for n in every}
    assert wanted <= exposed, wanted - exposed


# -- constructed sequences --------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[dm.Metrics, str]]:
    backend = dm.PrometheusBackend()
    address = backend.serve("127.0.0.1", 0)
    m = dm.Metrics(backend)
    try:
        yield m, address
    finally:
        m.close()


def ev(who: str, event: str, t: float = 0.0, **fields: Any) -> dict[str, Any]:
    """An event exactly as :class:`EventLog` writes it."""
    return {"t": t, "cpu": 0.0, "who": who, "event": event, **fields}


def test_a_failed_transition_and_a_failed_restore(served: tuple[dm.Metrics, str]) -> None:
    m, address = served
    m.add(fleet="f", role="coordinator", name="coordinator")
    attempt = {"attempt": 7, "mode": "mixed", "receivers": ["r0", "r1"], "refused": 0}
    retry = {**attempt, "attempt": 8, "mode": "overwrite", "receivers": ["r0"]}
    for e in [
        ev("coordinator", "active", epoch=1, address="tcp://127.0.0.1:1", keyed=False),
        ev("coordinator", "transition", base=4, take_over=False, required=["r0", "r1"],
           relative=10, refused_count=0, refused={}, unreported=[]),
        ev("coordinator", "disproved", base=4, receivers=["r1"], reasons={"r1": "sample"}),
        ev("coordinator", "ended", outcome="rejected", record=4, candidate="c4", base=4,
           committed_by=None, reason="prepare", attempts=[attempt], epoch=1, seconds=2.5),
        ev("coordinator", "dense", receiver="r1", job=9, version=4),
        ev("coordinator", "dense-failed", receiver="r1", job=9, endpoint="o0",
           check="arrival", message="missed"),
        ev("coordinator", "transition", base=4, take_over=False, required=["r0"],
           relative=10, refused_count=0, refused={}, unreported=[]),
        ev("coordinator", "ended", outcome="committed", record=5, candidate="c5", base=4,
           committed_by="coordinator", reason=None, attempts=[attempt, retry], epoch=1,
           seconds=4.0),
    ]:  # fmt: skip
        m.on_event(e)
    s = parse(scrape(address))
    assert value(s, "dcr_refits_total", outcome="rejected") == 1
    assert value(s, "dcr_refits_total", outcome="committed") == 1
    assert value(s, "dcr_refit_failures_total") == 1
    assert value(s, "dcr_attempt_failures_total") == 2  # the rejected one, the retried one
    assert value(s, "dcr_attempts_total", mode="mixed") == 2
    assert value(s, "dcr_refit_attempts_sum") == 2 and value(s, "dcr_refit_attempts_count") == 1
    assert value(s, "dcr_refit_phase_seconds_sum", phase="refit") == 4.0  # committed only
    assert value(s, "dcr_disproved_total") == 1
    assert value(s, "dcr_dense_refits_total", outcome="failed") == 1
    assert value(s, "dcr_committed_version") == 5
    assert value(s, "dcr_staleness_versions", receiver="r0") == 0
    assert value(s, "dcr_staleness_versions", receiver="r1") == 1  # held 4, left out of 5
    labels = {k: v for (n, ls), _ in s.items() if n == "dcr_committed_version" for k, v in ls}
    assert labels == {"fleet": "f", "role": "coordinator", "name": "coordinator"}


def test_object_storage_fetches_staleness_and_repeated_traffic(
    served: tuple[dm.Metrics, str],
) -> None:
    m, address = served
    m.add(fleet="f", role="receiver", name="r0")
    m.add(fleet="f", role="relay", name="relay-node0")
    m.add(fleet="f", role="owner", name="o0", elements=1000)
    for e in [
        ev("r0", "fetched", attempt=3, size=100, start=0.0, end=0.1, key="k1"),
        ev("r0", "fetched", attempt=3, size=50, start=0.0, end=0.1, key="k2"),
        # The root reports each attempt's running totals whenever they change.
        ev("relay-node0", "traffic", attempts={"3": [10, 10]}),
        ev("relay-node0", "traffic", attempts={"3": [30, 30], "4": [5, 5]}),
        ev("relay-node0", "state", held=0, held_bytes=123, receivers=[], peers_lost=0,
           peers_refused={}, grants_expired=0, auth={}, drops={}),
        # A trainer's own logs in the owner's process: its RL loop, its trainer log.
        ev("rl", "rl-step", step=3, version=3, rollout_version=1, staleness=1),
        ev("o0-trainer", "committed", version=2, candidate="c", seconds=1.0, attempts=[],
           payloads=0, payload_bytes=0, changed_elements=10, stage_s=0.0),
        ev("somebody-else", "committed", version=9, seconds=1.0, attempts=[]),
    ]:  # fmt: skip
        m.on_event(e)
    s = parse(scrape(address))
    assert value(s, "dcr_cross_bytes_total", name="r0") == 150
    assert value(s, "dcr_cross_bytes_total", name="relay-node0") == 35
    assert value(s, "dcr_relay_held_bytes") == 123
    assert value(s, "dcr_rollout_staleness_versions") == 1
    assert value(s, "dcr_committed_version", name="o0") == 2
    assert value(s, "dcr_refit_change_ratio") == 0.01
    assert m.errors == 0


def test_a_gate_closed_twice_counts_from_its_first_close(served: tuple[dm.Metrics, str]) -> None:
    m, address = served
    m.add(fleet="f", role="receiver", name="r0")
    for e in [
        ev("r0", "gate", 10.0, state="closed", start=9.9, drain_s=0.1),
        ev("r0", "applied", 10.5, attempt=1, owner="o0", payload=0),
        ev("r0", "gate", 11.0, state="closed", start=10.9, drain_s=0.1),  # the retry
        ev("r0", "applied", 12.0, attempt=2, owner="o0", payload=0),
        ev("r0", "gate", 12.5, state="open", closed_s=2.6),
        ev("r0", "gate", 20.0, state="open", closed_s=None),  # restored: closed from the start
    ]:  # fmt: skip
        m.on_event(e)
    s = parse(scrape(address))
    assert value(s, "dcr_gate_closed_seconds_count") == 1
    assert value(s, "dcr_gate_closed_seconds_sum") == 2.6
    assert value(s, "dcr_refit_phase_seconds_sum", phase="apply") == 2.0
    assert value(s, "dcr_refit_phase_seconds_sum", phase="commit") == 0.5
    assert value(s, "dcr_payloads_applied_total") == 2


def test_a_malformed_event_never_raises(served: tuple[dm.Metrics, str], capsys: Any) -> None:
    m, _ = served
    m.add(fleet="f", role="coordinator", name="coordinator")
    m.on_event(ev("coordinator", "ended", outcome="committed"))  # no base, no record
    m.on_event(ev("coordinator", "ended", outcome="committed"))
    assert m.errors == 2
    assert capsys.readouterr().err.count("could not be turned into metrics") == 1


def test_event_logs_call_listeners_before_the_line_is_written(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "coordinator")
    lines_at_call: list[int] = []

    def listener(e: Mapping[str, Any]) -> None:
        lines_at_call.append(len(log.path.read_text().splitlines()))
        raise RuntimeError("a listener that fails changes nothing")

    add_listener(listener)
    try:
        log.emit("active", epoch=1)
        log.emit("standby")
    finally:
        remove_listener(listener)
        log.close()
    assert lines_at_call == [0, 1]
    assert [json.loads(x)["event"] for x in log.path.read_text().splitlines()] == [
        "active", "standby",
    ]  # fmt: skip


def test_the_metrics_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_fleet(tmp_path / "a", refits=1)
    assert (cfg.metrics.port, cfg.metrics.host, cfg.metrics.ray) == (0, "127.0.0.1", False)
    assert metrics_ports(cfg) == {}
    cfg = small_fleet(tmp_path / "b", refits=1, extra="\n[metrics]\nport = 9400\n")
    ports = metrics_ports(cfg)
    assert list(ports.items())[:4] == [
        ("coordinator", 9400), ("coordinator-1", 9401), ("relay-node0", 9402),
        ("relay-node1", 9403),
    ]  # fmt: skip
    assert ports["r0"] == 9404 and ports["o3"] == 9400 + len(ports) - 1
    for bad in ("port = -1", "port = 70000", 'port = "9400"', 'host = ""', "ray = 1", "x = 1"):
        with pytest.raises(ConfigError, match="metrics"):
            small_fleet(tmp_path / "c", refits=1, extra=f"\n[metrics]\n{bad}\n")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'dcr\[metrics\]'"):
        load_fleet(cfg.path)


def test_metrics_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setattr(dm, "_PROCESS", None)
    assert dm.install(fleet="f", role="coordinator", name="c") is None
    assert not dm.in_ray_actor()  # Ray is not initialized in this process
    # Ray asked for outside a Ray actor, no port: a no-op, said once.
    m = dm.install(fleet="f", role="coordinator", name="c", ray=True)
    assert m is not None and isinstance(m.backend, dm.NullBackend)
    assert "not a Ray actor" in capsys.readouterr().err
    monkeypatch.setattr(dm, "_PROCESS", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    with pytest.raises(ConfigError, match=r"pip install 'dcr\[metrics\]'"):
        dm.install(fleet="f", role="coordinator", name="c", port=9400)
    assert dm.installed() is None


def test_one_naming_scheme() -> None:
    for name, metric in dm.METRICS.items():
        assert name == metric.name and name.startswith("dcr_")
        assert (metric.kind == "counter") == name.endswith("_total"), name
        assert metric.label_names[:3] == ("fleet", "role", "name")
        assert metric.roles and metric.help
        if "seconds" in name:
            assert metric.buckets == dm.SECONDS or metric.kind == "gauge"
    assert dm.RayBackend.exported_name(dm.METRICS["dcr_refits_total"]) == "dcr_refits"
    assert dm.union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 3.5)]) == 2.5
