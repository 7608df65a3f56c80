"""Per-refit metrics of a fleet's processes in Prometheus form, derived from their events.

Every role already reports what it does as events (:mod:`dcr.fleet.eventlog`): the
coordinator's ``transition`` and ``ended``, an owner's ``sent`` and ``committed``, a
receiver's ``applied``, ``gate`` and ``holds``, the relay root's ``traffic``.  This module
turns those events into metrics under one naming scheme -- every name starts with ``dcr_``,
values are in base units (seconds, bytes), counters end in ``_total``, and every series carries
the labels ``fleet``, ``role`` and ``name`` (the process) -- so that a role changes by one
line: the event log calls :meth:`Metrics.on_event` on every emit.

Two backends sit behind one small interface (:class:`Backend`): ``prometheus_client``, with a
registry of its own served over HTTP (:class:`PrometheusBackend`), and ``ray.util.metrics``
inside a Ray actor (:class:`RayBackend`; Ray's metrics agent exports them).  Neither library is
imported before it is used.  :data:`METRICS` lists every metric, its type, labels and meaning;
``docs/operations.md`` is the operator's view of the same.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from dcr.errors import ConfigError

__all__ = [
    "METRICS",
    "PREFIX",
    "Backend",
    "Metric",
    "Metrics",
    "NullBackend",
    "PrometheusBackend",
    "RayBackend",
    "RoleMetrics",
    "in_ray_actor",
    "install",
    "installed",
    "union_seconds",
]

PREFIX = "dcr_"
"""Every metric's name starts with it."""

LABELS = ("fleet", "role", "name")
"""The labels of every series: the fleet (``[fleet] name``), the process's role
(``coordinator``, ``owner``, ``receiver``, ``relay``) and its name (``coordinator``, ``o0``,
``r1``, ``relay-node0``, ...)."""

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0,
           300.0, 600.0)  # fmt: skip
"""Histogram buckets of durations (seconds)."""
ATTEMPTS = (1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 16.0)
"""Histogram buckets of attempts per refit."""

INSTALL_HINT = "pip install 'dcr[metrics]'"

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric of the scheme: its full name, type, help text, labels beyond
    :data:`LABELS`, the roles that report it and, for a histogram, its buckets."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        return (*LABELS, *self.labels)


def _m(name: str, kind: Kind, roles: str, help_: str, *labels: str, buckets: Sequence[float] = ())\
        -> Metric:  # fmt: skip
    return Metric(f"{PREFIX}{name}", kind, help_, tuple(labels), tuple(roles.split()),
                  tuple(buckets))  # fmt: skip


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        # -- refits, as the coordinator runs them ---------------------------------------------
        _m("refits_total", "counter", "coordinator",
           "Transitions this coordinator ended, by outcome (committed, conflict, rejected, "
           "aborted, ...).", "outcome"),
        _m("refit_failures_total", "counter", "coordinator",
           "Transitions that ended without moving the commit record."),
        _m("attempts_total", "counter", "coordinator",
           "Attempts registered, by mode (mixed, overwrite).", "mode"),
        _m("attempt_failures_total", "counter", "coordinator",
           "Attempts that did not commit (a retry followed, or the transition failed)."),
        _m("refit_attempts", "histogram", "coordinator",
           "Attempts of each committed transition (1: no retry).", buckets=ATTEMPTS),
        _m("dense_refits_total", "counter", "coordinator",
           "Dense refits of joining or restarted receivers, by outcome (started, restored, "
           "failed).", "outcome"),
        _m("disproved_total", "counter", "coordinator",
           "Receivers whose proof of the base version failed at a prepare."),
        _m("endpoint_restarts_total", "counter", "coordinator",
           "Owners and receivers the coordinator saw come back as a new process."),
        _m("coordinator_active", "gauge", "coordinator",
           "1 while this coordinator holds the lease, 0 while it is a standby."),
        _m("staleness_versions", "gauge", "coordinator",
           "Versions the receiver is behind the commit record, as far as this coordinator "
           "knows (0: it holds the committed version).", "receiver"),
        # -- every role ----------------------------------------------------------------------
        _m("committed_version", "gauge", "coordinator owner receiver",
           "The committed version this process knows: the coordinator's commit record, the "
           "owner's baseline, the version the receiver holds."),
        _m("refit_phase_seconds", "histogram", "coordinator owner receiver",
           "Seconds of one phase of a committed refit (see docs/operations.md for each "
           "phase).", "phase", buckets=SECONDS),
        # -- owners --------------------------------------------------------------------------
        _m("payloads_total", "counter", "owner",
           "Attempt payloads the transport accepted from this owner."),
        _m("payload_bytes_total", "counter", "owner",
           "Bytes of the attempt payloads the transport accepted from this owner (V_payload)."),
        _m("refit_payload_bytes", "gauge", "owner",
           "Payload bytes this owner sent for its last committed refit, every attempt."),
        _m("refit_changed_elements", "gauge", "owner",
           "Canonical elements whose stored bits changed in the last committed refit, among "
           "those this owner compares."),
        _m("refit_change_ratio", "gauge", "owner",
           "This owner's changed elements over all the model's canonical elements, last "
           "committed refit; summed over owners it is the fleet's change rate."),
        _m("rollout_staleness_versions", "gauge", "owner",
           "Versions between the policy a training step's rollouts came from and the one it "
           "trained (the RL loop's rl-step events)."),
        # -- the rollout side ----------------------------------------------------------------
        _m("cross_bytes_total", "counter", "relay receiver",
           "Bytes that crossed from the trainer side into the rollout side (V_cross): the relay "
           "root's receive path, or a receiver process's GETs on object storage."),
        _m("payloads_applied_total", "counter", "receiver",
           "Payloads applied in place (refits and dense restores)."),
        _m("gate_closed_seconds", "histogram", "receiver",
           "Seconds the request gate stayed closed, from the close call to the reopen.",
           buckets=SECONDS),
        _m("relay_held_bytes", "gauge", "relay",
           "Payload bytes the relay node holds now (granted room included at the root)."),
    )
}  # fmt: skip

PHASES = {
    "refit": "coordinator: from the transition's start to its commit, retries included",
    "publish": "owner: from publish() to the commit and this owner's baseline update",
    "stage": "owner: the residual exchange of staging in the trainer's process group",
    "construct": "owner: wall seconds while at least one bucket of the refit was built and "
    "encoded (the union of its `built` intervals; synthetic trainer)",
    "transport": "owner: wall seconds while at least one of its payloads was in the "
    "transport's hands (the union of its `sent` intervals; synthetic trainer)",
    "baseline": "owner: the baseline update after the commit",
    "apply": "receiver: from the gate closed (requests drained) to the last payload applied",
    "commit": "receiver: from the last payload applied to the gate reopened (flush, "
    "acknowledgement, the commit record's compare-and-set, the holds report)",
}
"""The ``phase`` label's values of ``dcr_refit_phase_seconds`` and what each measures."""


# -- backends ---------------------------------------------------------------------------------


class Backend(Protocol):
    """Where metric updates go: three calls, each with a metric of :data:`METRICS` and the
    values of all its labels."""

    address: str | None
    """Where the metrics can be read (a URL), when the backend serves them itself."""

    def inc(self, metric: Metric, labels: Mapping[str, str], value: float) -> None: ...

    def set(self, metric: Metric, labels: Mapping[str, str], value: float) -> None: ...

    def observe(self, metric: Metric, labels: Mapping[str, str], value: float) -> None: ...

    def close(self) -> None: ...


class NullBackend:
    """Metrics off: every update is dropped."""

    address: str | None = None

    def inc(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        pass

    def set(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        pass

    def observe(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        pass

    def close(self) -> None:
        pass


def prometheus_client_module() -> Any:
    """``prometheus_client``, or a :class:`ConfigError` saying how to install it."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ConfigError(
            f"[metrics] port is set, but prometheus_client is not installed: {INSTALL_HINT}",
            check="metrics",
        ) from exc


class PrometheusBackend:
    """``prometheus_client`` metrics in a registry of their own (never the library's global
    one, which a serving runtime such as vLLM may use itself), served by
    ``prometheus_client.start_http_server`` on ``host:port`` when :meth:`serve` is called."""

    def __init__(self) -> None:
        self._pc = prometheus_client_module()
        self.registry = self._pc.CollectorRegistry(auto_describe=True)
        self._made: dict[str, Any] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        self.port: int | None = None

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); returns its URL."""
        server, thread = self._pc.start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        self.port = int(server.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.address = f"http://{shown}:{self.port}/metrics"
        return self.address

    def _metric(self, metric: Metric) -> Any:
        made = self._made.get(metric.name)
        if made is None:
            names = list(metric.label_names)
            if metric.kind == "counter":
                made = self._pc.Counter(metric.name, metric.help, names, registry=self.registry)
            elif metric.kind == "gauge":
                made = self._pc.Gauge(metric.name, metric.help, names, registry=self.registry)
            else:
                made = self._pc.Histogram(
                    metric.name, metric.help, names, registry=self.registry, buckets=metric.buckets
                )
            self._made[metric.name] = made
        return made

    def inc(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        self._metric(metric).labels(**labels).inc(value)

    def set(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        self._metric(metric).labels(**labels).set(value)

    def observe(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        self._metric(metric).labels(**labels).observe(value)

    def exposition(self) -> str:
        """The registry in the Prometheus text format (what ``/metrics`` answers)."""
        return str(self._pc.generate_latest(self.registry).decode())

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


class RayBackend:
    """``ray.util.metrics`` inside a Ray actor: each node's metrics agent exports them in the
    Prometheus format on the node's metrics export port (Ray prefixes every name with
    ``ray_``).  Counters are made under the name without ``_total``: the export adds it."""

    address: str | None = None

    def __init__(self) -> None:
        self._metrics = importlib.import_module("ray.util.metrics")
        self._made: dict[str, Any] = {}

    @staticmethod
    def exported_name(metric: Metric) -> str:
        """The name Ray registers ``metric`` under (see the class)."""
        if metric.kind == "counter" and metric.name.endswith("_total"):
            return metric.name[: -len("_total")]
        return metric.name

    def _metric(self, metric: Metric) -> Any:
        made = self._made.get(metric.name)
        if made is None:
            name, keys = self.exported_name(metric), metric.label_names
            if metric.kind == "counter":
                made = self._metrics.Counter(name, description=metric.help, tag_keys=keys)
            elif metric.kind == "gauge":
                made = self._metrics.Gauge(name, description=metric.help, tag_keys=keys)
            else:
                made = self._metrics.Histogram(
                    name, description=metric.help, boundaries=list(metric.buckets), tag_keys=keys
                )
            self._made[metric.name] = made
        return made

    def inc(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        if value > 0:  # Ray refuses increments of 0
            self._metric(metric).inc(value, tags=dict(labels))

    def set(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        self._metric(metric).set(value, tags=dict(labels))

    def observe(self, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        self._metric(metric).observe(value, tags=dict(labels))

    def close(self) -> None:
        pass


def in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (``ray`` already imported and initialized, and
    the runtime context names an actor).  Never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # a Ray half torn down: not an actor we can report from
        return False


# -- from events to metric updates ------------------------------------------------------------


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``intervals`` (``(start, end)`` pairs)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


MAX_ATTEMPTS_HELD = 64
"""Attempts whose intervals an owner's metrics keep while waiting for their commit (the
oldest are dropped first: dense jobs that never commit)."""
MAX_INTERVALS = 4096
"""Intervals kept per attempt (merged into their union beyond this)."""


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _num(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (absent, null, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass(slots=True)
class RoleMetrics:
    """The metrics of one process of the fleet (``role``, ``name``), updated from its events.

    ``elements`` is the number of canonical elements of the model (the change ratio's
    denominator; ``None`` when the fleet file does not say what the model is)."""

    backend: Backend
    fleet: str
    role: str
    name: str
    elements: int | None = None
    _labels: dict[str, str] = field(init=False)
    # coordinator
    _held: dict[str, int] = field(default_factory=dict)
    _record: int | None = None
    # owner
    _built: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    _sent: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    # receiver
    _gate_closed_at: float | None = None
    _last_applied: float | None = None
    # relay root
    _traffic: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._labels = {"fleet": self.fleet, "role": self.role, "name": self.name}

    # -- updates ---------------------------------------------------------------------------

    def _metric(self, name: str) -> Metric:
        return METRICS[f"{PREFIX}{name}"]

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.backend.inc(self._metric(name), {**self._labels, **labels}, value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self.backend.set(self._metric(name), {**self._labels, **labels}, value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.backend.observe(self._metric(name), {**self._labels, **labels}, value)

    def phase(self, phase: str, seconds: float | None) -> None:
        if seconds is not None and seconds >= 0:
            self.observe("refit_phase_seconds", seconds, phase=phase)

    # -- events ----------------------------------------------------------------------------

    def on_event(self, e: Mapping[str, Any]) -> None:
        """Update the metrics from one event of this process (as :class:`EventLog` writes
        it: ``t``, ``who``, ``event`` and the event's fields)."""
        handler = _HANDLERS.get(str(e.get("event")))
        if handler is not None:
            handler(self, e)

    # coordinator

    def _active(self, e: Mapping[str, Any]) -> None:
        self.set("coordinator_active", 1.0)

    def _standby(self, e: Mapping[str, Any]) -> None:
        self.set("coordinator_active", 0.0)

    def _transition(self, e: Mapping[str, Any]) -> None:
        base = int(e["base"])
        self._record = base
        self.set("committed_version", base)
        for r in e.get("required") or ():
            self._held[str(r)] = base  # the required receivers hold the record exactly
        self._staleness()

    def _ended(self, e: Mapping[str, Any]) -> None:
        outcome, base, record = str(e["outcome"]), int(e["base"]), int(e["record"])
        attempts = list(e.get("attempts") or ())
        self.inc("refits_total", outcome=outcome)
        for a in attempts:
            self.inc("attempts_total", mode=str(a.get("mode")))
        moved = record > base
        failed = len(attempts) - 1 if moved and attempts else len(attempts)
        if failed:
            self.inc("attempt_failures_total", failed)
        if moved:
            self._record = record
            self.set("committed_version", record)
            if attempts:  # the receivers of the attempt that committed hold the new record
                for r in attempts[-1].get("receivers") or ():
                    self._held[str(r)] = record
            if outcome == "committed":
                self.observe("refit_attempts", len(attempts))
                self.phase("refit", _num(e.get("seconds")))
        else:
            self.inc("refit_failures_total")
        self._staleness()

    def _dense(self, e: Mapping[str, Any]) -> None:
        self.inc("dense_refits_total", outcome="started")

    def _restored(self, e: Mapping[str, Any]) -> None:
        self.inc("dense_refits_total", outcome="restored")
        self._held[str(e["receiver"])] = int(e["version"])
        self._staleness()

    def _dense_failed(self, e: Mapping[str, Any]) -> None:
        self.inc("dense_refits_total", outcome="failed")

    def _disproved(self, e: Mapping[str, Any]) -> None:
        self.inc("disproved_total", len(e.get("receivers") or ()))

    def _restarted(self, e: Mapping[str, Any]) -> None:
        self.inc("endpoint_restarts_total")

    def _staleness(self) -> None:
        if self._record is None:
            return
        for receiver, version in sorted(self._held.items()):
            self.set("staleness_versions", max(0, self._record - version), receiver=receiver)

    # owner

    def _started(self, e: Mapping[str, Any]) -> None:
        if e.get("role") == "owner" and _num(e.get("version")) is not None:
            self.set("committed_version", int(e["version"]))

    def _keep(self, held: dict[int, list[tuple[float, float]]], attempt: int,
              interval: tuple[float, float]) -> None:  # fmt: skip
        spans = held.setdefault(attempt, [])
        spans.append(interval)
        if len(spans) > MAX_INTERVALS:
            held[attempt] = _merge(spans)
        while len(held) > MAX_ATTEMPTS_HELD:
            del held[next(iter(held))]

    def _built_event(self, e: Mapping[str, Any]) -> None:
        start, end = _num(e.get("start")), _num(e.get("end"))
        if start is not None and end is not None and end >= start:
            self._keep(self._built, int(e["attempt"]), (start, end))

    def _sent_event(self, e: Mapping[str, Any]) -> None:
        size = _num(e.get("size")) or 0.0
        self.inc("payloads_total")
        self.inc("payload_bytes_total", size)
        start, end = _num(e.get("start")), _num(e.get("t"))
        if start is not None and end is not None and end >= start:
            self._keep(self._sent, int(e["attempt"]), (start, end))

    def _committed(self, e: Mapping[str, Any]) -> None:
        attempts = [int(a) for a in e.get("attempts") or ()]
        changed = int(e.get("changed_elements") or 0)
        self.set("committed_version", int(e["version"]))
        self.set("refit_payload_bytes", float(e.get("payload_bytes") or 0))
        self.set("refit_changed_elements", changed)
        if self.elements:
            self.set("refit_change_ratio", changed / self.elements)
        self.phase("publish", _num(e.get("seconds")))
        self.phase("stage", _num(e.get("stage_s")))
        built = [i for a in attempts for i in self._built.pop(a, ())]
        if built:
            self.phase("construct", union_seconds(built))
        sent = [i for a in attempts for i in self._sent.pop(a, ())]
        if sent:
            self.phase("transport", union_seconds(sent))

    def _baseline(self, e: Mapping[str, Any]) -> None:
        start, end = _num(e.get("start")), _num(e.get("end"))
        if start is not None and end is not None:
            self.phase("baseline", end - start)

    def _rl_step(self, e: Mapping[str, Any]) -> None:
        staleness = _num(e.get("staleness"))
        if staleness is not None:
            self.set("rollout_staleness_versions", staleness)

    # receiver

    def _gate(self, e: Mapping[str, Any]) -> None:
        t = float(e["t"])
        if e.get("state") == "closed":
            if self._gate_closed_at is None:  # a retry closes it again: count from the first
                self._gate_closed_at, self._last_applied = t, None
            return
        closed_s = _num(e.get("closed_s"))
        if closed_s is not None:
            self.observe("gate_closed_seconds", closed_s)
        if self._gate_closed_at is not None and self._last_applied is not None:
            self.phase("apply", self._last_applied - self._gate_closed_at)
            self.phase("commit", t - self._last_applied)
        self._gate_closed_at = self._last_applied = None

    def _applied(self, e: Mapping[str, Any]) -> None:
        self.inc("payloads_applied_total")
        if self._gate_closed_at is not None:
            self._last_applied = float(e["t"])

    def _holds(self, e: Mapping[str, Any]) -> None:
        self.set("committed_version", int(e["version"]))

    def _fetched(self, e: Mapping[str, Any]) -> None:
        self.inc("cross_bytes_total", _num(e.get("size")) or 0.0)

    # relay

    def _traffic_event(self, e: Mapping[str, Any]) -> None:
        for attempt, counts in dict(e.get("attempts") or {}).items():
            cross = float(counts[0])
            before = self._traffic.get(str(attempt), 0.0)
            self._traffic[str(attempt)] = cross
            if cross > before:
                self.inc("cross_bytes_total", cross - before)
        while len(self._traffic) > 4096:  # the root keeps its latest 1024 attempts
            del self._traffic[next(iter(self._traffic))]

    def _state(self, e: Mapping[str, Any]) -> None:
        held = _num(e.get("held_bytes"))
        if held is not None:
            self.set("relay_held_bytes", held)


_HANDLERS: dict[str, Callable[[RoleMetrics, Mapping[str, Any]], None]] = {
    "active": RoleMetrics._active,
    "standby": RoleMetrics._standby,
    "transition": RoleMetrics._transition,
    "ended": RoleMetrics._ended,
    "dense": RoleMetrics._dense,
    "restored": RoleMetrics._restored,
    "dense-failed": RoleMetrics._dense_failed,
    "disproved": RoleMetrics._disproved,
    "restarted": RoleMetrics._restarted,
    "started": RoleMetrics._started,
    "built": RoleMetrics._built_event,
    "sent": RoleMetrics._sent_event,
    "committed": RoleMetrics._committed,
    "baseline": RoleMetrics._baseline,
    "rl-step": RoleMetrics._rl_step,
    "gate": RoleMetrics._gate,
    "applied": RoleMetrics._applied,
    "holds": RoleMetrics._holds,
    "fetched": RoleMetrics._fetched,
    "traffic": RoleMetrics._traffic_event,
    "state": RoleMetrics._state,
}
"""Event kind -> what it updates."""


class Metrics:
    """The metrics of one process: a backend and the roles (:class:`RoleMetrics`) it hosts,
    fed every event the process's event logs write (:meth:`on_event`; thread-safe, and it never
    raises: metrics must not take a role down)."""

    def __init__(self, backend: Backend | None = None) -> None:
        self.backend: Backend = backend if backend is not None else NullBackend()
        self.roles: dict[str, RoleMetrics] = {}
        self._lock = threading.Lock()
        self.errors = 0
        """Events whose update raised (reported once on stderr)."""

    @property
    def address(self) -> str | None:
        return self.backend.address

    def add(self, *, fleet: str, role: str, name: str, elements: int | None = None) -> RoleMetrics:
        """Report the events of process ``name`` (once; a second call returns the first)."""
        with self._lock:
            found = self.roles.get(name)
            if found is None:
                found = self.roles[name] = RoleMetrics(
                    self.backend, fleet=fleet, role=role, name=name, elements=elements
                )
            return found

    def role_of(self, who: str) -> RoleMetrics | None:
        """The role an event of ``who`` belongs to: the process of that name, one of its own
        logs (``o0-trainer`` belongs to ``o0``), or for the RL loop's log (``rl``, in trainer
        rank 0's process) the process's only owner; anything else is not reported."""
        found = self.roles.get(who)
        if found is not None:
            return found
        owner = self.roles.get(who.split("-", 1)[0])
        if owner is not None and owner.role == "owner":
            return owner
        owners = [r for r in self.roles.values() if r.role == "owner"]
        return owners[0] if who == "rl" and len(owners) == 1 else None

    def on_event(self, e: Mapping[str, Any]) -> None:
        with self._lock:
            try:
                role = self.role_of(str(e.get("who", "")))
                if role is not None:
                    role.on_event(e)
            except Exception as exc:  # a malformed event: count it, say so once
                self.errors += 1
                if self.errors == 1:
                    print(f"dcr metrics: an event could not be turned into metrics "
                          f"({type(exc).__name__}: {exc}): {dict(e)}", file=sys.stderr,
                          flush=True)  # fmt: skip

    def close(self) -> None:
        self.backend.close()


# -- the process's metrics --------------------------------------------------------------------

_PROCESS: Metrics | None = None
_PROCESS_LOCK = threading.Lock()


def installed() -> Metrics | None:
    """This process's metrics, once :func:`install` set them up."""
    return _PROCESS


def _say(line: str) -> None:
    print(f"dcr metrics: {line}", file=sys.stderr, flush=True)


def _backend(*, port: int | None, host: str, ray: bool, who: str) -> Backend:
    """The backend a process uses: Ray's inside a Ray actor when ``ray``, else
    ``prometheus_client`` served on ``host:port`` when a port is given, else none."""
    if ray and in_ray_actor():
        try:
            return RayBackend()
        except ImportError as exc:
            _say(f"{who}: [metrics] ray = true, but ray.util.metrics is unavailable ({exc}); "
                 "no metrics")  # fmt: skip
            return NullBackend()
    if port is not None:
        backend = PrometheusBackend()
        try:
            address = backend.serve(host, port)
        except OSError as exc:
            _say(f"{who}: cannot serve metrics on {host}:{port} ({exc}); no metrics endpoint")
            return backend  # still counted, for a later look in-process
        _say(f"{who}: serving metrics at {address}")
        return backend
    if ray:
        _say(f"{who}: [metrics] ray = true, but this process is not a Ray actor and no "
             "[metrics] port applies to it; no metrics")  # fmt: skip
    return NullBackend()


def install(
    *,
    fleet: str,
    role: str,
    name: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    ray: bool = False,
    elements: int | None = None,
) -> Metrics | None:
    """Set up this process's metrics for process ``name`` of ``role`` (the first call picks
    the backend: :func:`_backend`; later calls add roles to it).  Returns them, or ``None``
    when metrics are off (no port and no Ray).  A port set without ``prometheus_client``
    installed is a :class:`ConfigError`."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            if port is None and not ray:
                return None
            _PROCESS = Metrics(_backend(port=port, host=host, ray=ray, who=name))
        metrics = _PROCESS
    metrics.add(fleet=fleet, role=role, name=name, elements=elements)
    return metrics


def uninstall() -> None:
    """Stop this process's metrics (its HTTP server) and forget them."""
    global _PROCESS
    with _PROCESS_LOCK:
        metrics, _PROCESS = _PROCESS, None
    if metrics is not None:
        metrics.close()
