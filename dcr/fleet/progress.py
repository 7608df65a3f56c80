"""What the processes of a fleet run report, as the launcher follows it: each refit's row
(:class:`RefitRow`), the bit-for-bit checks of every receiver, the planned faults struck at
their points, lockstep, and the run's report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dcr.fleet.checks import check_fingerprints, proof_from_json
from dcr.fleet.config import FleetConfig
from dcr.fleet.eventlog import EventReader
from dcr.fleet.faults import Fault
from dcr.fleet.model import FleetModel
from dcr.fleet.processes import _Proc
from dcr.protocol.proof import Proof

__all__ = ["FleetProgress", "RefitRow"]


@dataclass(slots=True)
class RefitRow:
    """What the launcher saw of the transition to one version."""

    version: int
    attempts: list[dict[str, Any]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    disproved: list[str] = field(default_factory=list)
    """Receivers whose proof of the base version failed at a prepare of this refit."""
    checks: dict[str, bool] = field(default_factory=dict)
    """Receiver -> whether its report of this version matched the dense load."""
    payload_bytes: int = 0
    started: float | None = None
    ended: float | None = None
    cross: tuple[int, int] | None = None
    """(V_cross, V_payload) the root counted for the transition's attempts."""

    @property
    def seconds(self) -> float:
        if self.started is None or self.ended is None:
            return 0.0
        return self.ended - self.started

    @property
    def bit_exact(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "bit_exact": self.bit_exact,
            "payload_bytes": self.payload_bytes,
            "attempts": [a["mode"] for a in self.attempts],
            "killed": list(self.killed),
            "disproved": sorted(self.disproved),
            "seconds": round(self.seconds, 3),
            "receivers_checked": sorted(self.checks),
            "v_cross": self.cross[0] if self.cross else None,
            "v_payload": self.cross[1] if self.cross else None,
        }


class FleetProgress:
    """The events of a fleet run, followed: refits, checks, faults, lockstep and the report.

    The launcher (:class:`~dcr.fleet.launcher.Launcher`) owns the processes; it feeds their
    events here and kills the one a planned fault names (:meth:`kill`).
    """

    procs: dict[str, _Proc]
    """Process name -> the process (the launcher's)."""

    def __init__(
        self,
        cfg: FleetConfig,
        *,
        faults: Sequence[Fault] = (),
        say: Callable[[str], None] = lambda line: None,
        deadline_s: float = 3600.0,
        watch: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = FleetModel(cfg)
        self.faults = list(faults)
        self.say = say
        self.deadline_s = deadline_s
        self.watch = watch
        """Called with every event any process of the fleet reports (progress of a trainer
        of your own, say)."""
        self.rows: dict[int, RefitRow] = {}
        self.mismatches: list[str] = []
        self.kills: list[tuple[int, str]] = []
        self._reader = EventReader(cfg.events_dir)
        self._expected: dict[int, dict[tuple[int, int], dict[str, str]]] = {}
        self._state_version = -1
        self._state: dict[str, Any] = {}
        self._active: str | None = None
        self._sizes: dict[int, int] = {}
        """Attempt -> payload bytes the owners sent for it."""
        self._traffic: dict[int, tuple[int, int]] = {}
        """Attempt -> (V_cross, V_payload) the root counted."""
        self._committed = 0
        self._go = 0
        """Lockstep: the last version the trainer was let publish."""
        self._stepped: dict[int, set[str]] = {}
        """Version -> trainer ranks that computed it (lockstep)."""
        self._checked: dict[int, set[str]] = {}
        """Version -> receivers whose report of it was checked."""
        self._last: dict[str, dict[str, Any]] = {}
        """Process -> its latest event (what a timeout reports)."""
        self._fingerprints: dict[tuple[str, int], dict[str, Proof]] = {}
        """(engine, version) -> its ranks' fingerprints of that version reported so far."""
        self.checks = cfg.trainer.synthetic
        """Whether receivers are checked bit for bit against the versions computed here
        (the synthetic trainer's); another trainer's versions are known only to it, and its
        receivers are proved against its owners by the protocol instead."""
        self._trained: dict[str, int] = {}
        """Owner -> the version it reported ``trained`` at (its last step)."""

    def kill(self, name: str, version: int, *, down_s: float = 0.0) -> None:
        """SIGKILL one process now (a planned fault during the refit to ``version``)."""
        raise NotImplementedError

    def _write_faults(self) -> None:
        """The planned fault points the processes offer themselves up to (atomically)."""
        planned = [
            {"target": f.target, "version": f.version, "point": f.after} for f in self.faults
        ]
        tmp = self.cfg.run_dir / "faults.json.tmp"
        tmp.write_text(json.dumps(planned))
        tmp.replace(self.cfg.run_dir / "faults.json")

    # -- events ------------------------------------------------------------------------------

    def _row(self, version: int) -> RefitRow:
        return self.rows.setdefault(version, RefitRow(version=version))

    def _canonical(self, version: int) -> dict[str, torch.Tensor]:
        """The canonical tensors of ``version`` (advanced from the last version asked for)."""
        if version != self._state_version:
            run = self.model.run
            if version < self._state_version or not self._state:
                self._state = run.state(version)
            else:
                for v in range(self._state_version + 1, version + 1):
                    run.advance(self._state, v)
            self._state_version = version
        return self._state

    def _expected_digests(self, version: int) -> dict[tuple[int, int], dict[str, str]]:
        if version not in self._expected:
            state = self._canonical(version)
            specs = [r for r in self.cfg.receivers if self.cfg.engine_of(r.name) is None]
            self._expected[version] = self.model.expected_digests(state, specs)
        return self._expected[version]

    def _on_event(self, e: dict[str, Any]) -> None:
        if self.watch is not None:
            self.watch(e)
        who, kind = e["who"], e["event"]
        self._last[who] = e
        if kind == "active":
            self._active = who
            self.say(f"{who} is the active coordinator (epoch {e['epoch']})")
        elif kind == "transition":
            row = self._row(int(e["base"]) + 1)
            row.started = row.started if row.started is not None else e["t"]
        elif kind == "ended":
            row = self._row(int(e["base"]) + 1)
            row.attempts.extend(e["attempts"])
            if e["outcome"] in ("committed", "conflict") and int(e["record"]) > int(e["base"]):
                row.ended = e["t"]
                self._committed = max(self._committed, int(e["record"]))
                self._advance_faults()
                self.say(
                    f"refit {row.version}: {e['outcome']} after "
                    f"{' → '.join(a['mode'] for a in row.attempts) or 'takeover'}"
                )
            else:
                self.say(f"refit {row.version}: {e['outcome']} ({e['reason']})")
        elif kind == "sent":
            self._sizes[int(e["attempt"])] = self._sizes.get(int(e["attempt"]), 0) + e["size"]
        elif kind == "traffic" and who.startswith("relay-"):
            for attempt, (cross, payload) in e["attempts"].items():
                self._traffic[int(attempt)] = (int(cross), int(payload))
        elif kind == "disproved":
            self._row(int(e["base"]) + 1).disproved.extend(e["receivers"])
            self.say(f"refit {int(e['base']) + 1}: disproved {', '.join(e['receivers'])}")
        elif kind == "holds":
            if "digests" in e:
                self._check(who, int(e["version"]), e["digests"])
            elif "proof" in e:
                self._check_fingerprint(who, int(e["version"]), proof_from_json(e["proof"]))
            self._checked.setdefault(int(e["version"]), set()).add(who)
        elif kind == "trained" and who in self.cfg.owners:
            self._trained[who] = int(e["version"])
        elif kind == "stepped":
            self._stepped.setdefault(int(e["version"]), set()).add(who)
        elif kind in ("restarted", "dense-failed", "replaced"):
            self.say(f"{who}: {kind} {e.get('endpoint') or e.get('receiver') or ''}".rstrip())
        if kind == "fault-point":
            self._strike(e)

    def _check(self, receiver: str, version: int, found: dict[str, str]) -> None:
        spec = self.cfg.receiver(receiver)
        want = self._expected_digests(version)[(spec.tp, spec.rank)]
        bad = sorted(n for n in set(want) | set(found) if want.get(n) != found.get(n))
        if version > 0:
            self._row(version).checks[receiver] = not bad
        if bad:
            self.mismatches.append(f"{receiver} v{version}: {bad[:3]}")
            self.say(f"[red]{receiver} holds v{version} with {len(bad)} mismatching tensors")

    def _check_fingerprint(self, receiver: str, version: int, proof: Proof) -> None:
        """Check an engine's ranks once each reported its fingerprint of ``version``."""
        engine = self.cfg.engine_of(receiver)
        if engine is None:
            return
        reported = self._fingerprints.setdefault((engine.name, version), {})
        reported[receiver] = proof
        if set(reported) != set(engine.receivers):
            return
        del self._fingerprints[(engine.name, version)]
        served = self.model.rollout(self._canonical(version))
        failed = check_fingerprints(version, served, reported)
        for name in engine.receivers:
            if version > 0:
                self._row(version).checks[name] = name not in failed
            if name in failed:
                self.mismatches.append(f"{name} v{version}: {failed[name]}")
                self.say(f"[red]{name} holds v{version} with other bits: {failed[name]}")

    def expected_receivers(self) -> set[str]:
        """The receivers whose reports the run waits for (all of the fleet file's)."""
        return {r.name for r in self.cfg.receivers}

    def _lockstep(self) -> None:
        """``[trainer] lockstep``: let the trainer publish version ``k`` once every rank
        computed it and every receiver's report of ``k - 1`` was checked (``go.json``)."""
        if not self.cfg.trainer.lockstep:
            return
        k = self._go + 1
        receivers = self.expected_receivers()
        if set(self.cfg.owners) <= self._stepped.get(k, set()) and receivers <= self._checked.get(
            k - 1, set()
        ):
            tmp = self.cfg.run_dir / "go.json.tmp"
            tmp.write_text(json.dumps({"version": k}))
            tmp.replace(self.cfg.run_dir / "go.json")
            self._go = k

    def _advance_faults(self) -> None:
        """A fault whose refit was committed before its moment came moves to the next one."""
        late = [i for i, f in enumerate(self.faults) if f.version < self._next(f)]
        for i in late:
            f = self.faults[i]
            self.faults[i] = replace(f, version=self._next(f))
        if late:
            self._write_faults()

    def _next(self, fault: Fault) -> int:
        """The earliest version ``fault`` can still strike at: the next refit, or for a
        restore or a flip the committed version (a receiver restores or holds it after a
        commit)."""
        return self._committed if fault.after in ("dense", "flip") else self._committed + 1

    def _strike(self, e: dict[str, Any]) -> None:
        """A process stopped at a planned fault point: SIGKILL it there (or the relay node
        the fault names, while the receiver waits)."""
        who = e["who"]
        self._advance_faults()
        for fault in list(self.faults):
            hit = fault.version == e["version"] and fault.after == e["point"]
            if hit and fault.after == "flip" and fault.target == who:
                self.faults.remove(fault)  # the receiver corrupted itself: nothing to kill
                self._write_faults()
                return
            if hit and fault.target == e.get("target", who):
                # Kill first: a process waiting at its fault point resumes once the fault
                # leaves the plan, and a relay node must be gone by then.
                name = fault.target if fault.target.startswith("relay-") else who
                self.kill(name, fault.version, down_s=fault.down_s)
                self.faults.remove(fault)
                self._write_faults()
                return

    # -- the run -----------------------------------------------------------------------------

    def target(self) -> int | None:
        """The trainer's last version: ``[model] refits`` for the synthetic trainer; for any
        other, the version every rank reported ``trained`` at (``None`` until all did)."""
        if self.cfg.trainer.synthetic:
            return self.cfg.model.refits
        if set(self._trained) < set(self.cfg.owners):
            return None
        return max(self._trained.values())

    def _supervise(self) -> None:
        """Restart what died (the launcher its processes; on Ray, the trainer group)."""

    def follow(self, t0: float) -> None:
        """Follow the roles' events until the last version is committed and checked on every
        receiver expected; past ``deadline_s`` after ``t0`` a ``TimeoutError`` says where the
        fleet stands."""
        while not self.done():
            if time.monotonic() - t0 > self.deadline_s:
                raise TimeoutError(self._stalled())
            for e in self._reader.poll():
                self._on_event(e)
            self._supervise()
            self._lockstep()
            time.sleep(0.05)

    def done(self) -> bool:
        last = self.target()
        if last is None or self._committed < last:
            return False
        receivers = self.expected_receivers()
        if not self.checks:
            return receivers <= self._checked.get(last, set())
        row = self.rows.get(last)
        return row is not None and set(row.checks) >= receivers

    def _stalled(self) -> str:
        """Where the fleet stands, for an operator (or a test log) when it did not finish."""
        now = time.time()
        last = "; ".join(
            f"{who}: {e['event']} {now - e['t']:.0f} s ago" for who, e in sorted(self._last.items())
        )
        return (
            f"the fleet did not finish within {self.deadline_s:.0f} s: version "
            f"{self._committed} of {self.target() or '?'} committed, active coordinator "
            f"{self._active}; latest events: {last}; logs and events in {self.cfg.run_dir}"
        )

    def _traffic_complete(self) -> bool:
        """Whether the root reported, for every attempt, at least the payload bytes the
        owners said they sent (a report taken mid-attempt is partial)."""
        return all(
            self._traffic.get(a["attempt"], (0, -1))[1] >= self._sizes.get(a["attempt"], 0)
            for row in self.rows.values()
            for a in row.attempts
        )

    def report(self, seconds: float) -> dict[str, Any]:
        rows = []
        for v in range(1, (self.target() or self._committed) + 1):
            row = self._row(v)
            row.payload_bytes = sum(self._sizes.get(a["attempt"], 0) for a in row.attempts)
            seen = [
                self._traffic[a["attempt"]] for a in row.attempts if a["attempt"] in self._traffic
            ]
            if seen:
                row.cross = (sum(c for c, _ in seen), sum(p for _, p in seen))
            rows.append(row.as_dict())
        if not self.checks:
            for r in rows:
                r["bit_exact"] = None  # nothing here to check against: the protocol proved them
        exact = not self.mismatches and all(r["bit_exact"] is not False for r in rows)
        return {
            "processes": len(self.procs),
            "starts": sum(p.starts for p in self.procs.values()),
            "sigkills": [{"version": v, "process": n} for v, n in self.kills],
            "checkpoint_bytes": self.model.checkpoint_bytes if self.checks else None,
            "bit_exact": exact,
            "mismatches": self.mismatches,
            "seconds": round(seconds, 2),
            "refits": rows,
        }
