"""Fleet events: what each process reports, one JSON object per line, one file per process.

Processes append to ``<run_dir>/events/<process>.jsonl``; the launcher tails every file to
show progress, to strike faults at the right moment and to build the per-refit report.  A
file per process keeps lines whole without any locking across processes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["NAMES_SHOWN", "EventLog", "EventReader"]

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
        line = json.dumps({"t": time.time(), "cpu": round(time.process_time(), 4),
                           "who": self.who, "event": event, **fields})  # fmt: skip
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
