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

The launcher holds the processes; following their events (checks, faults, the report) is
:class:`~dcr.fleet.progress.FleetProgress`, the processes themselves are
:mod:`dcr.fleet.processes` and the planned faults :mod:`dcr.fleet.faults`.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, free_port
from dcr.fleet.faults import Fault
from dcr.fleet.processes import _kill, _last_line, _Proc, _signal
from dcr.fleet.progress import FleetProgress, RefitRow
from dcr.fleet.runtime import LAUNCHED, relayed
from dcr.fleet.sections import EngineSection

__all__ = ["RUN_DIR_MARKER", "Launcher", "clear_run_dir"]

RUN_DIR_MARKER = ".dcr-run-dir"
"""The file ``dcr fleet`` writes in every run directory it uses: only a directory holding it
is cleared before a run, and only of what a fleet writes there."""

_RUN_ENTRIES = frozenset({
    RUN_DIR_MARKER, "commit.db", "ports.json", "faults.json", "faults.json.tmp", "go.json",
    "go.json.tmp", "events", "logs", "trainer", "objects", "fetches",
})  # fmt: skip
"""What the processes of a fleet write in its run directory: the SQLite commit record, the
relay ports, the planned faults, the lockstep go, event files, logs, the trainer's own
checkpoints, a directory transport's objects and a node's shared fetches."""
_RUN_PATTERNS = ("ports.json.*.tmp", "engine-*.ready.json", "engine-*.ready.json.tmp")


def clear_run_dir(cfg: FleetConfig) -> list[str]:
    """Clear the fleet's run directory for a fresh run: remove what a fleet wrote there (the
    SQLite record, ``ports.json``, ``events/``, ``logs/``, ``trainer/``, ...), keep anything
    else; returns the names of the entries kept.

    A directory that does not exist or is empty is fine.  A directory that holds other files
    and no :data:`RUN_DIR_MARKER` (``dcr fleet`` did not make it), or that holds the fleet
    file itself (``run_dir = "."`` or one above it), is refused with a
    :class:`~dcr.errors.ConfigError` and nothing in it is touched."""
    run_dir = cfg.run_dir
    where = run_dir.resolve()
    home = cfg.path.resolve().parent
    if where == home or where in home.parents:
        raise ConfigError(
            f"{cfg.path}: [fleet] run_dir = {str(run_dir)!r} is the fleet file's directory or "
            "one above it: dcr fleet clears its run directory before every run, so give the "
            'fleet a directory of its own (run_dir = "run", the default)',
            check="run-dir",
        )
    if not run_dir.exists() and not run_dir.is_symlink():
        return []
    if not run_dir.is_dir():
        raise ConfigError(
            f"{cfg.path}: [fleet] run_dir {run_dir} is not a directory: remove it or name "
            "another run_dir",
            check="run-dir",
        )
    entries = sorted(run_dir.iterdir())
    if entries and not (run_dir / RUN_DIR_MARKER).is_file():
        raise ConfigError(
            f"{cfg.path}: [fleet] run_dir {run_dir} is not empty and was not made by dcr fleet "
            f"(it holds no {RUN_DIR_MARKER}): dcr fleet clears its run directory before every "
            "run, so it does not take a directory holding other files; set run_dir to a new "
            "or empty directory, or empty this one yourself",
            check="run-dir",
        )
    store = cfg.store_path()
    folder = store.parent.resolve()
    if folder == where or where in folder.parents:  # a SQLite record in the run directory
        for path in folder.glob(glob.escape(store.name) + "*"):
            if _of_store(path.name, store.name) and (path.is_symlink() or not path.is_dir()):
                path.unlink(missing_ok=True)
    kept = []
    for entry in entries:
        if entry.name in _RUN_ENTRIES or any(entry.match(p) for p in _RUN_PATTERNS):
            _remove(entry)
        elif entry.exists() or entry.is_symlink():
            kept.append(entry.name)
    return kept


def _of_store(name: str, store: str) -> bool:
    """Whether ``name`` is the SQLite file ``store`` or one beside it (``-wal``, ``-shm``,
    ``-journal``, a ``.``-suffixed marker)."""
    return name == store or name.startswith((store + "-", store + "."))


def _remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Launcher(FleetProgress):
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
        super().__init__(cfg, faults=faults, say=say, deadline_s=deadline_s, watch=watch)
        self.procs: dict[str, _Proc] = {}
        self._trainer_store: Any = None
        self._stopping = False

    # -- processes ---------------------------------------------------------------------------

    def _argv(self, role: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "dcr.cli", role, "--fleet", str(self.cfg.path), *extra]

    def _prepare_run_dir(self) -> None:
        made = self.cfg.ensure_keys()  # one host: the launcher starts every identity
        if made:
            self.say(f"made key pairs for {len(made)} identities in {self.cfg.keys}")
        kept = clear_run_dir(self.cfg)
        if kept:
            self.say(f"kept what dcr fleet did not write in {self.cfg.run_dir}: {', '.join(kept)}")
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (self.cfg.run_dir / RUN_DIR_MARKER).write_text(
            "made by dcr fleet; the next run of the fleet clears what the fleet wrote here\n"
        )
        (self.cfg.run_dir / "logs").mkdir()
        ports = {n.name: n.port or free_port(self.cfg.host) for n in self.cfg.rollout}
        self.cfg.ports_file.write_text(json.dumps(ports))
        self._write_faults()
        self._fresh_storage()

    def _fresh_storage(self) -> None:
        """A fresh run starts from version 0 with attempt ids that begin again: empty an
        object-store transport and an S3 commit record the fleet file names (the run
        directory, with a directory transport's default path and a SQLite record in it, was
        just cleared)."""
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

    def _rendezvous(self) -> int:
        """A fresh rendezvous store for the trainer ranks, held here and listening on the
        fleet's host only (:func:`~dcr.fleet.trainer.rendezvous_store`); returns its port."""
        from dcr.fleet.trainer import rendezvous_store

        self._trainer_store = rendezvous_store(self.cfg.host, self.cfg.world_size + 1)
        return int(self._trainer_store.port)

    def _start_trainer(self) -> None:
        """(Re)start every trainer rank around a fresh rendezvous store held here."""
        port = str(self._rendezvous())
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
        from dcr.tensors.fp8 import rollout_catalog

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
        if self.cfg.trainer.synthetic and any(r.kind == "sharded" for r in self.cfg.receivers):
            self.model.require_synthetic()
        fleet_checkpoint = self.cfg.model.checkpoint
        served = [(f"[model] checkpoint = {fleet_checkpoint!r}", fleet_checkpoint)]
        served += [(f"[[engine]] {e.name!r} model = {e.model!r}", e.model)
                   for e in self.cfg.engines]  # fmt: skip
        scheme = self.cfg.model.fp8

        def served_by(catalog: Mapping[str, Any], engine: bool) -> Mapping[str, Any]:
            # An FP8 rollout: engines serve the FP8 export of the trained (BF16) catalog.
            return rollout_catalog(catalog, scheme) if engine and scheme is not None else catalog

        for where, checkpoint in served:
            if checkpoint is None:
                continue
            found = read_catalog(checkpoint)
            engine = where.startswith("[[engine]]")
            if engine and scheme is not None and checkpoint == fleet_checkpoint:
                raise ConfigError(
                    f"{self.cfg.path}: {where} serves the BF16 [model] checkpoint, but [model] "
                    'rollout_dtype = "fp8": give it the FP8 export (dcr fp8 export) as model',
                    check="catalog",
                )
            if trained is not None:
                check_catalog(served_by(trained[1], engine), found, expected_from=trained[0],
                              found_from=where)  # fmt: skip
            elif fleet_checkpoint is not None and checkpoint != fleet_checkpoint:
                check_catalog(
                    served_by(read_catalog(fleet_checkpoint), engine), found,
                    expected_from=f"[model] checkpoint = {fleet_checkpoint!r}"
                    + (" (its FP8 rollout)" if engine and scheme is not None else ""),
                    found_from=where,
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
        for node in self.cfg.rollout if relayed(self.cfg) else ():
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

    def kill(self, name: str, version: int, *, down_s: float = 0.0) -> None:
        """SIGKILL one process now (a planned fault during the refit to ``version``), the
        engine of an engine-hosted receiver; supervision restarts it (``down_s`` later)."""
        proc = self.procs[self._process_of(name)]
        if proc.popen is not None and proc.popen.poll() is None:
            _kill(proc)
            proc.down_until = time.monotonic() + down_s
            self.kills.append((version, proc.name))
            self.rows.setdefault(version, RefitRow(version=version)).killed.append(proc.role)
            self.say(f"SIGKILL {proc.name} (pid {proc.popen.pid}) during refit {version}")

    def _supervise(self) -> None:
        trainer_down = False
        for proc in self.procs.values():
            if proc.popen is None or proc.popen.poll() is None:
                continue
            if time.monotonic() < proc.down_until:
                continue  # a planned fault keeps it down a while
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
            self.follow(t0)
            # The root reports its traffic every quarter second: wait (briefly) for the last.
            settle = time.monotonic() + (5.0 if relayed(self.cfg) else 0.0)
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
