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

import math
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dcr.metrics.backends import (
    Backend,
    NullBackend,
    PrometheusBackend,
    RayBackend,
    in_ray_actor,
    prometheus_client_module,
)
from dcr.metrics.names import ATTEMPTS, LABELS, METRICS, PHASES, PREFIX, SECONDS, Metric

__all__ = [
    "ATTEMPTS",
    "LABELS",
    "METRICS",
    "PHASES",
    "SECONDS",
    "PREFIX",
    "Backend",
    "Metric",
    "Metrics",
    "NullBackend",
    "prometheus_client_module",
    "PrometheusBackend",
    "RayBackend",
    "RoleMetrics",
    "in_ray_actor",
    "install",
    "installed",
    "union_seconds",
]

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
