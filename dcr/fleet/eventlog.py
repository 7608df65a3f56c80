"""Fleet events: what each process reports, one JSON object per line, one file per process.

Processes append to ``<run_dir>/events/<process>.jsonl``; the launcher tails every file to
show progress, to strike faults at the right moment and to build the per-refit report.  A
file per process keeps lines whole without any locking across processes.

Within a process, listeners (:func:`add_listener`) see every event any of its event logs
writes, before the line is written: the process's metrics (:func:`install_metrics`,
:mod:`dcr.metrics`) are updated that way, so that whoever reads an event from a file finds
the metrics of that process already counting it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcr.engine.receiver import ReceiverHooks
    from dcr.fleet.config import FleetConfig

__all__ = [
    "NAMES_SHOWN",
    "EventLog",
    "EventReader",
    "add_listener",
    "gate_events",
    "install_metrics",
    "metrics_ports",
    "remove_listener",
]

Listener = Callable[[Mapping[str, Any]], None]
_LISTENERS: list[Listener] = []


def add_listener(listener: Listener) -> None:
    """Call ``listener`` with every event any event log of this process writes (the event as
    a dict, before its line is written; in the emitting thread).  Once per listener; a
    listener that raises is ignored for that event."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def remove_listener(listener: Listener) -> None:
    with contextlib.suppress(ValueError):
        _LISTENERS.remove(listener)


NAMES_SHOWN = 16
"""How many tensor names an event lists where a model may have thousands (the first, sorted;
a count says how many there are)."""


class EventLog:
    """Appends events of one process (``who``) to its own file; each write is one line.

    Every event carries ``t`` (wall clock, shared by the processes of a host) and ``cpu``,
    the CPU seconds the process has used so far (all its threads): what a role cost between
    two of its events.
    """

    def __init__(self, directory: Path, who: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.who = who
        self.path = directory / f"{who}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "cpu": round(time.process_time(), 4), "who": self.who,
                  "event": event, **fields}  # fmt: skip
        line = json.dumps(record)
        for listener in tuple(_LISTENERS):
            with contextlib.suppress(Exception):
                listener(record)
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EventReader:
    """Reads every process's events as they are appended (complete lines only)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}

    def poll(self) -> Iterator[dict[str, Any]]:
        """New events since the last poll, file by file."""
        if not self.directory.exists():
            return
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = offset + end
            for line in data[:end].splitlines():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


class FaultPoints:
    """Planned faults a process offers itself up to (``<run_dir>/faults.json``, written by
    the launcher): at a planned point -- a receiver applied a payload of the refit to a given
    version, an owner sent one, the coordinator got a reply -- the process reports
    ``fault-point`` and waits, so that the launcher's SIGKILL lands exactly mid-refit.  A
    process whose launcher does not strike goes on after ``wait_s``."""

    def __init__(self, path: Path, who: str, log: EventLog, *, wait_s: float = 30.0) -> None:
        self.path = path
        self.who = who
        self.log = log
        self.wait_s = wait_s

    def reached(
        self, point: str, version: int, *, role: str = "", also: tuple[str, ...] = ()
    ) -> None:
        """Called at ``point`` of the refit to ``version`` (from a worker thread: it blocks).

        A fault matches when its target is this process, its role, or one of ``also`` (a
        relay node this process depends on: the launcher kills that one instead).  The
        process waits until the launcher has struck (the fault leaves the plan) or
        ``wait_s`` passed.
        """
        fault = self._planned(point, version, (self.who, role, *also))
        if fault is None:
            return
        self.log.emit("fault-point", point=point, version=version, target=fault["target"])
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and self._planned(point, version, (fault["target"],)):
            time.sleep(0.02)

    def planned(self, point: str, version: int, *, role: str = "") -> bool:
        """Whether a fault is planned for this process (or ``role``) at ``point``."""
        return self._planned(point, version, (self.who, role)) is not None

    def _planned(self, point: str, version: int, targets: tuple[str, ...]) -> dict | None:  # type: ignore[type-arg]
        try:
            plan = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        for fault in plan:
            if (
                fault.get("point") == point
                and fault.get("version") == version
                and fault.get("target") in targets
            ):
                return dict(fault)
        return None


def gate_events(log: EventLog, hooks: ReceiverHooks | None) -> ReceiverHooks:
    """``hooks`` (or the default ones) reporting the request gate in ``log``: ``gate`` with
    ``state="closed"`` once a close returned (``start``: when it was called, ``drain_s``: how
    long the requests in flight took to finish), and ``state="open"`` once a reopen returned
    (``closed_s``: seconds since the first close call before it; ``None`` when the gate was
    closed from the start, as for a receiver restored by dense refit)."""
    from dcr.engine.receiver import ReceiverHooks

    inner = hooks if hooks is not None else ReceiverHooks()
    closed_since: list[float] = []

    async def close_gate() -> None:
        start, wall = time.monotonic(), time.time()
        await inner.close_gate()
        if not closed_since:
            closed_since.append(start)
        log.emit("gate", state="closed", start=wall, drain_s=time.monotonic() - start)

    async def open_gate() -> None:
        await inner.open_gate()
        closed_s = time.monotonic() - closed_since.pop() if closed_since else None
        log.emit("gate", state="open", closed_s=closed_s)

    return replace(inner, close_gate=close_gate, open_gate=open_gate)


def metrics_ports(cfg: FleetConfig) -> dict[str, int]:
    """Process name -> the port its metrics are served on (``[metrics] port`` plus the
    process's place in this order: the coordinators (``coordinator``, ``coordinator-1``, ...
    as many as the launcher or Ray starts), every rollout node's relay node
    (``relay-<node>``), every receiver, every owner); empty when ``port`` is 0."""
    base = cfg.metrics.port
    if not base:
        return {}
    coordinators = max(1 + cfg.coordinator.standbys, cfg.ray.coordinators)
    names = [
        *("coordinator" if i == 0 else f"coordinator-{i}" for i in range(coordinators)),
        *(f"relay-{n.name}" for n in cfg.rollout),
        *(r.name for r in cfg.receivers),
        *cfg.owners,
    ]
    return {name: base + i for i, name in enumerate(names)}


def _model_elements(cfg: FleetConfig) -> int | None:
    """Canonical elements of the fleet's model, when the fleet file says what it is."""
    if cfg.model.checkpoint is None and not cfg.trainer.synthetic:
        return None
    from dcr.errors import DcrError
    from dcr.fleet.model import FleetModel

    try:
        return sum(spec.numel for spec in FleetModel(cfg).catalog.values())
    except (DcrError, OSError, KeyError, TypeError, ValueError):
        return None


def install_metrics(cfg: FleetConfig, role: str, name: str) -> None:
    """Report this process's events (process ``name`` of ``role``) as metrics, as the fleet
    file's ``[metrics]`` asks (:func:`dcr.metrics.install`; nothing when it asks for none).
    Raises :class:`~dcr.errors.ConfigError` when ``port`` is set and ``prometheus_client``
    is missing."""
    m = cfg.metrics
    if not m.port and not m.ray:
        return
    from dcr import metrics

    port = metrics_ports(cfg).get(name) if m.port else None
    if m.port and port is None:
        print(f"dcr metrics: {name}: the fleet file gives this process no metrics port "
              "(see dcr.fleet.eventlog.metrics_ports)", file=sys.stderr, flush=True)  # fmt: skip
    installed = metrics.install(
        fleet=cfg.name, role=role, name=name, port=port, host=m.host, ray=m.ray,
        elements=_model_elements(cfg) if role == "owner" else None,
    )  # fmt: skip
    if installed is not None:
        add_listener(installed.on_event)
