"""Where :mod:`dcr.metrics` updates go: ``prometheus_client`` (a registry of its own served
over HTTP), ``ray.util.metrics`` inside a Ray actor, or nowhere.  Neither library is imported
before it is used."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from dcr.errors import ConfigError
from dcr.metrics.names import INSTALL_HINT, Metric

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
