"""``dcr fleet``: start every process of a fleet, supervise them by pid, stop them cleanly.

The launcher starts the relay nodes (of a relay tree; a fleet over object storage has none),
the coordinator and its standbys, the receivers and the trainer ranks (owners) of a fleet
file, each as its own OS process running ``dcr <role>``, and restarts what dies: a receiver
(it rejoins by dense refit), a relay node (at the same
address, so its receivers reconnect), a coordinator (it comes back as a standby), and the
whole trainer when one rank dies (a broken torch.distributed group is restarted as a whole,
as torchrun does; the ranks resume at the committed version).  Receivers that are the workers
of an ``[[engine]]`` run in that vLLM engine (``python -m dcr.integrations.vllm``), started in
a process group of its own (front end, engine core, workers) that is stopped, killed and
restarted as a whole.  It follows the processes'
event files to show progress, to strike planned faults (SIGKILL of a role at a chosen moment)
and to check every receiver bit for bit: each receiver reports digests of its parameters (an
engine's workers: the fingerprint of their stored bits, :mod:`dcr.fleet.checks`) whenever it
holds a committed version, and the launcher compares them with that version's canonical
tensors computed here.  On exit every child is stopped, SIGTERM first, then SIGKILL;
children also die with the launcher (``PR_SET_PDEATHSIG``; an engine process shuts its
engine down when the launcher dies).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcr.errors import ConfigError
from dcr.fleet.checks import check_fingerprints, proof_from_json
from dcr.fleet.config import EngineSection, FleetConfig, free_port
from dcr.fleet.eventlog import EventReader
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import LAUNCHED
from dcr.protocol.proof import Proof

__all__ = ["Fault", "Launcher", "RefitRow", "default_faults", "fault_plan", "random_faults"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """SIGKILL ``target`` mid-refit to ``version``.

    ``after`` is where: ``"applied"`` (receiver ``target`` applied a payload of that refit),
    ``"sent"`` (owner ``target`` sent one), ``"replied"`` (the active coordinator --
    ``target="coordinator"`` -- got an endpoint's reply in that refit), ``"dense"`` (a
    receiver applied a payload of the dense refit restoring ``version`` after it joined).
    The process stops at that point and reports it (:class:`~dcr.fleet.eventlog.FaultPoints`),
    so the SIGKILL lands exactly there.  A relay node (``target="relay-<node>"``) is killed
    while a receiver it hosts stops at its point (``"applied"`` or ``"dense"``): the rest of
    the refit is still in flight through that node.  ``"flip"`` kills nothing: receiver
    ``target`` flips one stored bit once it holds ``version`` (silent corruption the proof
    of the base version must catch at the next prepare).
    """

    version: int
    target: str
    after: str = "applied"


def _relayed(cfg: FleetConfig) -> bool:
    """Whether the fleet's payloads travel through relay processes (not object storage)."""
    from dcr.fleet.runtime import relayed

    return relayed(cfg)


def default_faults(cfg: FleetConfig) -> list[Fault]:
    """The demo's plan from refit 2 on: a receiver, an owner, the active coordinator and a
    relay node (when the fleet has a relay tree), each SIGKILLed mid-refit, cycling."""
    receivers = [r.name for r in cfg.receivers]
    victim_rx = receivers[1] if len(receivers) > 1 else receivers[0]
    relay = cfg.rollout[-1].name
    plan = [
        (victim_rx, "applied"),
        (cfg.owners[min(1, len(cfg.owners) - 1)], "sent"),
        ("coordinator", "replied"),
    ]
    if _relayed(cfg):
        plan.append((f"relay-{relay}", "applied"))
    return [
        Fault(version=v, target=plan[(v - 2) % len(plan)][0], after=plan[(v - 2) % len(plan)][1])
        for v in range(2, cfg.model.refits + 1)
    ]


def random_faults(cfg: FleetConfig, seed: int, *, per_refit: int = 1) -> list[Fault]:
    """``per_refit`` SIGKILLs in every refit from 2 on, each of a role drawn at random
    (receivers, trainer ranks, the active coordinator, relay nodes), at its fault point."""
    import random

    rng = random.Random(seed)
    choices = [(r.name, "applied") for r in cfg.receivers]
    choices += [(o, "sent") for o in cfg.owners]
    choices += [("coordinator", "replied")]
    if _relayed(cfg):
        choices += [(f"relay-{n.name}", "applied") for n in cfg.rollout]
    plan = []
    for v in range(2, cfg.model.refits + 1):
        for target, after in rng.sample(choices, per_refit):
            plan.append(Fault(version=v, target=target, after=after))
    return plan


def fault_plan(cfg: FleetConfig, kind: str | None, seed: int = 0) -> list[Fault]:
    """``None``: no faults; ``"plan"``: :func:`default_faults`; ``"random"``:
    :func:`random_faults` seeded by ``seed``."""
    if kind is None:
        return []
    return default_faults(cfg) if kind == "plan" else random_faults(cfg, seed)


@dataclass(slots=True)
class _Proc:
    name: str
    role: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    group: bool = False
    """Runs in a process group of its own (an engine and its children), signalled as one."""
    env: dict[str, str] = field(default_factory=dict)
    stop_s: float = 10.0


def _last_line(log: Path) -> str:
    """``": <the last line of log>"`` (what a crashed process said last), or ``""``."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [x for x in lines if x]
    return f": {lines[-1][:300]}" if lines else ""


_GROUP_GONE_S = 60.0
"""How long the processes of a killed group may take to disappear."""


def _signal(proc: _Proc, signum: int) -> None:
    """Send ``signum`` to the process, or to its whole group."""
    assert proc.popen is not None
    if proc.group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signum)
    elif proc.popen.poll() is None:
        proc.popen.send_signal(signum)


def _kill(proc: _Proc) -> None:
    """SIGKILL the process (and every process left in its group) and wait until gone."""
    assert proc.popen is not None
    _signal(proc, signal.SIGKILL)
    proc.popen.wait()
    if proc.group:
        deadline = time.monotonic() + _GROUP_GONE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.05)


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


class Launcher:
    """Runs a fleet until the trainer's last version is committed and checked everywhere."""

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
        self.procs: dict[str, _Proc] = {}
        self.rows: dict[int, RefitRow] = {}
        self.mismatches: list[str] = []
        self.kills: list[tuple[int, str]] = []
        self._reader = EventReader(cfg.events_dir)
        self._trainer_store: Any = None
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
        self._stopping = False
        self._last: dict[str, dict[str, Any]] = {}
        """Process -> its latest event (what a timeout reports)."""
        self._fingerprints: dict[tuple[str, int], dict[str, Proof]] = {}
        self.checks = cfg.trainer.synthetic
        """Whether receivers are checked bit for bit against the versions computed here
        (the synthetic trainer's); another trainer's versions are known only to it, and its
        receivers are proved against its owners by the protocol instead."""
        self._trained: dict[str, int] = {}
        """Owner -> the version it reported ``trained`` at (its last step)."""
        """(engine, version) -> its ranks' fingerprints of that version reported so far."""

    # -- processes ---------------------------------------------------------------------------

    def _argv(self, role: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "dcr.cli", role, "--fleet", str(self.cfg.path), *extra]

    def _prepare_run_dir(self) -> None:
        if self.cfg.run_dir.exists():
            shutil.rmtree(self.cfg.run_dir)
        self.cfg.run_dir.mkdir(parents=True)
        (self.cfg.run_dir / "logs").mkdir()
        ports = {n.name: n.port or free_port(self.cfg.host) for n in self.cfg.rollout}
        self.cfg.ports_file.write_text(json.dumps(ports))
        self._write_faults()
        self._fresh_storage()

    def _fresh_storage(self) -> None:
        """A fresh run starts from version 0 with attempt ids that begin again: empty an
        object-store transport and an S3 commit record the fleet file names (the run
        directory, with a directory transport's default path and a SQLite record in it, was
        just removed)."""
        import anyio

        from dcr.adapters.commit.s3 import S3CommitStore
        from dcr.adapters.registry import load
        from dcr.adapters.transport.objstore import ObjectStoreTransport
        from dcr.fleet.runtime import make_store, make_transport, transport_class

        async def clear() -> None:
            if issubclass(transport_class(self.cfg), ObjectStoreTransport):
                transport = make_transport(self.cfg)
                try:
                    if isinstance(transport, ObjectStoreTransport):
                        await transport.purge()
                finally:
                    await transport.aclose()
            if issubclass(load("commit_store", self.cfg.commit_store["kind"]), S3CommitStore):
                store = make_store(self.cfg)
                try:
                    if isinstance(store, S3CommitStore):
                        await store.reset()
                finally:
                    await store.close()

        anyio.run(clear, backend="asyncio")

    def _write_faults(self) -> None:
        """The planned fault points the processes offer themselves up to (atomically)."""
        planned = [
            {"target": f.target, "version": f.version, "point": f.after} for f in self.faults
        ]
        tmp = self.cfg.run_dir / "faults.json.tmp"
        tmp.write_text(json.dumps(planned))
        tmp.replace(self.cfg.run_dir / "faults.json")

    def _log_of(self, proc: _Proc) -> Path:
        return self.cfg.run_dir / "logs" / f"{proc.name}.log"

    def _spawn(self, proc: _Proc) -> None:
        log = self._log_of(proc).open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", LAUNCHED: "1",
               **proc.env}  # fmt: skip
        proc.popen = subprocess.Popen(
            proc.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=proc.group,
        )  # fmt: skip
        log.close()
        proc.starts += 1

    def _add(self, name: str, role: str, argv: list[str], **options: Any) -> None:
        proc = _Proc(name=name, role=role, argv=argv, **options)
        self.procs[name] = proc
        self._spawn(proc)

    def _engine_argv(self, engine: EngineSection) -> list[str]:
        """``python -m dcr.integrations.vllm`` for ``engine``: its workers join the fleet as
        its receivers, report fingerprints for the checks, and stop with the launcher."""
        model = engine.model or self.cfg.model.checkpoint
        assert model is not None  # the fleet file check requires one
        ready = self.cfg.run_dir / f"engine-{engine.name}.ready.json"
        argv = [sys.executable, "-m", "dcr.integrations.vllm", "--model", model,
                "--tp", str(len(engine.receivers)), "--dtype", engine.dtype,
                "--fleet", str(self.cfg.path), "--receivers", ",".join(engine.receivers),
                "--stop-with-parent",
                "--ready-file", str(ready)]  # fmt: skip
        if self.checks:
            argv.append("--report-fingerprints")
        if engine.plain_weights:
            argv.append("--plain-weights")
        if engine.max_model_len is not None:
            argv += ["--max-model-len", str(engine.max_model_len)]
        if not engine.prefix_caching:
            argv.append("--no-prefix-cache")
        if not engine.chunked_prefill:
            argv.append("--no-chunked-prefill")
        if engine.checkpoint_version is not None:
            argv += ["--checkpoint-version", str(engine.checkpoint_version)]
        if engine.pause_mode is not None:
            argv += ["--pause-mode", engine.pause_mode]
        return argv

    def _process_of(self, name: str) -> str:
        """The process that hosts ``name``: an engine for its workers' receivers."""
        engine = self.cfg.engine_of(name)
        return f"engine-{engine.name}" if engine is not None else name

    def _start_trainer(self) -> None:
        """(Re)start every trainer rank around a fresh rendezvous store held here."""
        import torch.distributed as dist

        self._trainer_store = dist.TCPStore(  # type: ignore[attr-defined]
            self.cfg.host, 0, self.cfg.world_size + 1, is_master=True, wait_for_workers=False
        )
        port = str(self._trainer_store.port)
        # A trainer of your own may also form its group the usual way (env://): rank 0
        # hosts that store.
        master = str(free_port(self.cfg.host))
        for rank, name in enumerate(self.cfg.owners):
            argv = self._argv("owner", "--rank", str(rank), "--store-port", port)
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(self.cfg.world_size), "LOCAL_WORLD_SIZE":
                   str(self.cfg.world_size), "MASTER_ADDR": self.cfg.host, "MASTER_PORT": master,
                   "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
            if name in self.procs:
                self.procs[name].argv = argv
                self.procs[name].env = env
                self._spawn(self.procs[name])
            else:
                self._add(name, "owner", argv, env=env)

    def preflight(self) -> None:
        """Check, before any process starts, that every kind the fleet file names can be
        loaded: the trainer, each receiver runtime (a ``torch`` runtime's factory too), each
        engine's checkpoint against the fleet's catalog; raises :class:`~dcr.errors.
        ConfigError` naming the key, the value and what was expected."""
        from dcr.adapters.registry import load_factory
        from dcr.catalog import check_catalog, read_catalog
        from dcr.fleet.trainer import trainer_kind

        trainer = trainer_kind(self.cfg)
        trained = self._trainer_catalog(trainer)
        for r in self.cfg.receivers:
            if r.kind == "vllm":
                continue
            try:
                load_factory("receiver", r.kind)
                factory = r.options.get("factory")
                if r.kind == "torch" and isinstance(factory, str):
                    load_factory("receiver", factory)
            except ConfigError as exc:
                raise ConfigError(
                    f"{self.cfg.path}: receiver {r.name!r} runtime = {r.kind!r}: {exc}"
                ) from exc
        if self.cfg.trainer.synthetic and any(r.kind == "reference" for r in self.cfg.receivers):
            self.model.require_synthetic()
        fleet_checkpoint = self.cfg.model.checkpoint
        served = [(f"[model] checkpoint = {fleet_checkpoint!r}", fleet_checkpoint)]
        served += [(f"[[engine]] {e.name!r} model = {e.model!r}", e.model)
                   for e in self.cfg.engines]  # fmt: skip
        for where, checkpoint in served:
            if checkpoint is None:
                continue
            found = read_catalog(checkpoint)
            if trained is not None:
                check_catalog(trained[1], found, expected_from=trained[0], found_from=where)
            elif fleet_checkpoint is not None and checkpoint != fleet_checkpoint:
                check_catalog(
                    read_catalog(fleet_checkpoint), found,
                    expected_from=f"[model] checkpoint = {fleet_checkpoint!r}", found_from=where,
                )  # fmt: skip

    def _trainer_catalog(self, trainer: Any) -> tuple[str, Mapping[str, Any]] | None:
        """What the trainer kind says it trains (its ``catalog(ctx)``, when it has one)."""
        catalog = getattr(trainer, "catalog", None)
        if not callable(catalog):
            return None
        from dcr.fleet.trainer import TrainerContext

        ctx = TrainerContext(
            fleet=self.cfg, rank=0, world_size=self.cfg.world_size,
            options=dict(self.cfg.trainer.options),
        )  # fmt: skip
        return f"[trainer] kind = {self.cfg.trainer.kind!r}", catalog(ctx)

    def start(self) -> None:
        self.preflight()
        self._prepare_run_dir()
        for node in self.cfg.rollout if _relayed(self.cfg) else ():
            self._add(f"relay-{node.name}", "relay", self._argv("relay", "--node", node.name))
        for i in range(1 + self.cfg.coordinator.standbys):
            name = "coordinator" if i == 0 else f"coordinator-{i}"
            self._add(name, "coordinator", self._argv("coordinator", "--name", name))
        for r in self.cfg.receivers:
            if self.cfg.engine_of(r.name) is None:
                self._add(r.name, "receiver", self._argv("receiver", "--name", r.name))
        for e in self.cfg.engines:
            self._add(f"engine-{e.name}", "engine", self._engine_argv(e), group=True,
                      env=dict(e.env), stop_s=e.stop_s)  # fmt: skip
        self._start_trainer()
        self.say(f"started {len(self.procs)} processes (run directory {self.cfg.run_dir})")

    def kill(self, name: str, version: int) -> None:
        """SIGKILL one process now (a planned fault during the refit to ``version``), the
        engine of an engine-hosted receiver; supervision restarts it."""
        proc = self.procs[self._process_of(name)]
        if proc.popen is not None and proc.popen.poll() is None:
            _kill(proc)
            self.kills.append((version, proc.name))
            self.rows.setdefault(version, RefitRow(version=version)).killed.append(proc.role)
            self.say(f"SIGKILL {proc.name} (pid {proc.popen.pid}) during refit {version}")

    def _supervise(self) -> None:
        trainer_down = False
        for proc in self.procs.values():
            if proc.popen is None or proc.popen.poll() is None:
                continue
            code = proc.popen.returncode
            if proc.role == "owner":
                trainer_down = True
                continue
            why = "" if code in (0, -signal.SIGKILL) else _last_line(self._log_of(proc))
            self.say(f"{proc.name} exited ({code}){why}; restarting it")
            if proc.group:
                _kill(proc)  # what its leader left behind
            self._spawn(proc)
        if trainer_down:
            self.say("a trainer rank exited: restarting the whole trainer at the committed version")
            for proc in self.procs.values():
                if proc.role == "owner" and proc.popen is not None and proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGKILL)
                    proc.popen.wait()
            self._start_trainer()

    def stop(self) -> None:
        """SIGTERM every child, then SIGKILL what is left after a grace period (an engine's
        ``stop_s``; its whole process group)."""
        self._stopping = True
        live = [p for p in self.procs.values() if p.popen is not None]
        for p in live:
            _signal(p, signal.SIGTERM)
        start = time.monotonic()
        for p in live:
            assert p.popen is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.1, start + max(p.stop_s, 10.0) - time.monotonic()))
            if p.group or p.popen.poll() is None:
                _kill(p)
        self._trainer_store = None

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
        failed = check_fingerprints(version, self._canonical(version), reported)
        for name in engine.receivers:
            if version > 0:
                self._row(version).checks[name] = name not in failed
            if name in failed:
                self.mismatches.append(f"{name} v{version}: {failed[name]}")
                self.say(f"[red]{name} holds v{version} with other bits: {failed[name]}")

    def _lockstep(self) -> None:
        """``[trainer] lockstep``: let the trainer publish version ``k`` once every rank
        computed it and every receiver's report of ``k - 1`` was checked (``go.json``)."""
        if not self.cfg.trainer.lockstep:
            return
        k = self._go + 1
        receivers = {r.name for r in self.cfg.receivers}
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
            self.faults[i] = Fault(version=self._next(f), target=f.target, after=f.after)
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
                self.kill(fault.target if fault.target.startswith("relay-") else who, fault.version)
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

    def done(self) -> bool:
        last = self.target()
        if last is None or self._committed < last:
            return False
        receivers = {r.name for r in self.cfg.receivers}
        if not self.checks:
            return receivers <= self._checked.get(last, set())
        row = self.rows.get(last)
        return row is not None and set(row.checks) >= receivers

    def run(self, *, before_stop: Callable[[], None] | None = None) -> dict[str, Any]:
        """Start the fleet, run it to the last version, stop it; returns the report.

        ``before_stop`` is called once the last version is committed and checked on every
        receiver, while every process still runs (to look at the fleet before it stops: an
        engine's HTTP API, say)."""
        t0 = time.monotonic()

        def terminate(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)  # runs stop() below: children stop cleanly

        previous = signal.signal(signal.SIGTERM, terminate)
        self.start()
        try:
            while not self.done():
                if time.monotonic() - t0 > self.deadline_s:
                    raise TimeoutError(self._stalled())
                for e in self._reader.poll():
                    self._on_event(e)
                self._supervise()
                self._lockstep()
                time.sleep(0.05)
            # The root reports its traffic every quarter second: wait (briefly) for the last.
            settle = time.monotonic() + (5.0 if _relayed(self.cfg) else 0.0)
            while not self._traffic_complete() and time.monotonic() < settle:
                for e in self._reader.poll():
                    self._on_event(e)
                time.sleep(0.05)
            if before_stop is not None:
                before_stop()
        finally:
            self.stop()
            signal.signal(signal.SIGTERM, previous)
        return self.report(time.monotonic() - t0)

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
