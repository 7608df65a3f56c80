"""``dcr rl``: a GRPO loop on CPU with real parts, refitted by dcr or by dense reloads.

One run writes version 0 of a small Qwen3 policy (:mod:`dcr.rl.policy`), then:

* ``--refit delta`` writes a fleet file and runs it with the fleet launcher
  (:class:`~dcr.fleet.launcher.Launcher`): two trainer ranks of the FSDP2 GRPO trainer
  (``[trainer] kind = "fsdp"``), one vLLM CPU engine whose workers are dcr receivers
  (``[[engine]]``, TP 1 or 2), a coordinator, and the relay tree (or object storage: a
  directory, or S3 on a SeaweedFS server started here).  ``--faults`` SIGKILLs the engine
  mid-refit twice and a trainer rank once; the launcher restarts them and they recover.
* ``--refit dense`` is the reference: the same trainer and engine, no fleet; after every step
  the ranks write the full checkpoint and the engine loads it through vLLM's own loader.

Rank 0 reports every step (reward, KL, loss, a digest of the sampled tokens, staleness,
refit seconds and bytes); the run prints a line per step as it goes, a table at the end, and
with ``--json`` one object.  The same seed gives the same run: delta and dense runs agree on
every step's numbers and tokens and on the final weights, bit for bit.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError
from dcr.fleet.eventlog import EventReader
from dcr.fleet.runtime import LAUNCHED
from dcr.rl.config import RLConfig
from dcr.rl.loop import MODES, REFITS, ROLLOUT_DTYPES, RunSpec
from dcr.rl.report import COMPARED, _Steps, compare_runs, format_rl_table
from dcr.tensors.fp8 import Fp8Scheme

__all__ = [
    "BACKENDS",
    "COMPARED",
    "TRANSPORTS",
    "RLOptions",
    "compare_runs",
    "format_rl_table",
    "run_rl",
]

TRANSPORTS = ("relay", "s3", "directory")
BACKENDS = ("process", "ray")
RAY_NAMESPACE = "dcr-rl"

MARKER = ".dcr-rl-run"
"""A file in every run directory ``dcr rl`` made: only such a directory is cleared."""
RUN_ENTRIES = frozenset({MARKER, "checkpoint-v0", "checkpoint-v0-fp8", "fleet.toml", "run",
                         "trainer", "objects", "seaweed", "keys"})  # fmt: skip
"""What a run writes in its directory: the only entries the next run removes."""

ENGINE_ENV = {
    # One compute thread per worker, no CPU binding: the same kernels and reduction order in
    # every engine process, so sampling is a function of the weights and the batch.
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RLOptions:
    """What ``dcr rl`` runs (its command-line options)."""

    steps: int = 20
    refit: str = "delta"
    transport: str = "relay"
    mode: str = "sync"
    tp: int = 1
    faults: bool = False
    seed: int = 0
    max_staleness: int | None = None
    """Default: 1 in asynchronous mode, 0 in synchronous mode."""
    directory: Path = Path("out/rl")
    rl: RLConfig = field(default_factory=RLConfig)
    deadline_s: float = 3600.0
    backend: str = "process"
    """``process``: the fleet launcher's processes on this machine; ``ray``: a local Ray
    cluster of four nodes started here, the fleet's roles as actors (:mod:`dcr.rl.ray`)."""
    keys: bool = True
    """The delta fleet's key directory (``<dir>/keys``, made per run): CURVE on every socket,
    sealed payloads.  ``False``: no keys (loopback only)."""
    rollout_dtype: str = "bf16"
    """``fp8``: the engine serves the FP8 export of every version (``dcr fp8 export``) while
    the trainer stays BF16; delta refits re-quantize only what changed."""
    fp8_block: int | None = None
    """FP8 scale tiles (``block x block``); ``None`` (default): per output channel, the FP8
    format vLLM's CPU build computes with."""

    def __post_init__(self) -> None:
        if self.refit not in REFITS:
            raise ConfigError(f"--refit is one of {REFITS}, got {self.refit!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--transport is one of {TRANSPORTS}, got {self.transport!r}")
        if self.mode not in MODES:
            raise ConfigError(f"--mode is one of {MODES}, got {self.mode!r}")
        if self.tp not in (1, 2):
            raise ConfigError(f"--tp is 1 or 2, got {self.tp}")
        if self.faults and self.refit != "delta":
            raise ConfigError("--faults kills processes of a dcr fleet: it needs --refit delta")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend is one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "ray" and self.refit != "delta":
            raise ConfigError(
                "--backend ray runs the delta fleet on Ray: the dense reference "
                "runs as processes (--refit dense without --backend ray)"
            )
        if self.faults and self.steps < 4:
            raise ConfigError("--faults needs at least 4 steps (three kills from step 2 on)")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ConfigError(
                f"--rollout-dtype is one of {ROLLOUT_DTYPES}, got {self.rollout_dtype!r}"
            )
        if self.fp8_block is not None and self.rollout_dtype != "fp8":
            raise ConfigError(
                "--fp8-block sets the scales of an FP8 rollout: add --rollout-dtype fp8"
            )

    @property
    def fp8(self) -> Fp8Scheme | None:
        """The engine's FP8 scheme, ``None`` when it serves BF16."""
        return Fp8Scheme(self.fp8_block) if self.rollout_dtype == "fp8" else None

    @property
    def staleness(self) -> int:
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.mode == "async" else 0


def _fresh(directory: Path) -> None:
    """Clear ``directory`` for a new run -- only if it is empty or a previous run's, and then
    only of what a run writes there (:data:`RUN_ENTRIES`); other files are kept."""
    if directory.exists():
        entries = list(directory.iterdir())
        if entries and not (directory / MARKER).is_file():
            raise ConfigError(
                f"{directory} is not empty and not a dcr rl run directory: choose another --dir"
            )
        for entry in entries:
            if entry.name not in RUN_ENTRIES:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("made by dcr rl; cleared by the next run in this directory\n")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} to a fleet file")


def _table(name: str, values: dict[str, Any]) -> str:
    lines = [f"[{name}]"]
    lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def faults_plan(steps: int) -> list[tuple[int, str, str]]:
    """``--faults``: ``(version, target, point)``: the engine (its receiver ``r0``) killed
    after applying a payload of two refits, a trainer rank (owner ``o1``) killed after sending
    a payload of one refit in between."""
    first, last = 2, steps - 1 if steps > 4 else steps
    middle = max(first + 1, (first + last) // 2)
    if middle >= last:
        middle, last = first + 1, first + 2
    return [(first, "r0", "applied"), (middle, "o1", "sent"), (last, "r0", "applied")]


def _fleet_file(
    opts: RLOptions, spec: RunSpec, checkpoint: Path, directory: Path, s3: dict[str, Any] | None
) -> Path:
    """The fleet of ``--refit delta``: one rollout node with the engine's receivers; on Ray a
    relay-only root node first (on a rollout node of its own) and ``[ray]`` placement.  An FP8
    rollout serves the FP8 export of version 0 (``[model] rollout_dtype``)."""
    receivers = [f"r{r}" for r in range(opts.tp)]
    transport: dict[str, Any] = {"kind": opts.transport}
    if opts.transport == "directory":
        transport["path"] = str(directory / "objects")
    elif opts.transport == "s3":
        assert s3 is not None
        transport.update(s3)
    # TOML has no null: fields left at None take their defaults when the ranks read them.
    options = {k: v for k, v in spec.to_dict().items() if v is not None}
    rl = options.pop("rl")
    trainer = {"kind": "fsdp", "ranks": 2, "chunk_mb": 4.0, "bucket_mb": 4.0, "timeout_s": 1800.0}
    coordinator = {
        "standbys": 0,
        "sync": opts.mode == "sync",
        "join_wait_s": 600.0,
        "dense_timeout_s": 600.0,
    }
    timeouts = {
        "prepare_s": 600.0,
        "arrival_s": 300.0,
        "gate_s": 600.0,
        "flush_s": 600.0,
        "commit_s": 5.0,
        "stop_s": 60.0,
        "baseline_s": 3.0,
    }
    rollout = [{"name": r, "tp": opts.tp, "rank": i} for i, r in enumerate(receivers)]
    nodes = [_table("[rollout]", {"name": "node0", "receivers": rollout})]
    if opts.backend == "ray":
        nodes.insert(0, _table("[rollout]", {"name": "root", "receivers": []}))
        nodes.insert(0, _table("ray", {"namespace": RAY_NAMESPACE, "coordinators": 2}))
    fleet = {"name": "rl", "run_dir": "run", **({"keys": "keys"} if opts.keys else {})}
    model: dict[str, Any] = {"checkpoint": str(checkpoint)}
    engine: dict[str, Any] = {"name": "e0"}
    if opts.fp8 is not None:
        block = "channel" if opts.fp8.block is None else opts.fp8.block
        model.update(rollout_dtype="fp8", fp8_block=block)
        engine["model"] = str(_served(checkpoint, opts))
    engine |= {
        "receivers": receivers,
        "plain_weights": True,
        "checkpoint_version": 0,
        "pause_mode": "wait",
        "max_model_len": 64,
        "prefix_caching": False,
        "chunked_prefill": False,
        "stop_s": 30.0,
        "env": ENGINE_ENV,
    }
    text = "\n".join(
        [
            "# The fleet of `dcr rl --refit delta`: written and run by dcr rl.",
            _table("fleet", fleet),
            _table("model", model),
            _table("trainer", trainer),
            _table("trainer.options", options),
            _table("trainer.options.rl", rl),
            _table("coordinator", coordinator),
            _table("coordinator.timeouts", timeouts),
            _table("transport", transport),
            *nodes,
            _table("[engine]", engine),
        ]
    )
    path = directory / "fleet.toml"
    path.write_text(text)
    from dcr.fleet.config import load_fleet

    load_fleet(path).ensure_keys()
    return path


def _spec(opts: RLOptions, directory: Path, checkpoint: Path, ready: Path | str) -> RunSpec:
    return RunSpec(
        steps=opts.steps,
        seed=opts.seed,
        mode=opts.mode,
        max_staleness=opts.staleness,
        refit=opts.refit,
        checkpoint=str(checkpoint),
        engine_ready=str(ready),
        state_dir=str(directory / "trainer"),
        events_dir=str(directory / "run" / "events"),
        rl=opts.rl.to_dict(),
        rollout_dtype=opts.rollout_dtype,
        fp8_block=opts.fp8_block,
    )


def _served(checkpoint: Path, opts: RLOptions) -> Path:
    """The checkpoint of version 0 the engine serves: ``checkpoint``, or its FP8 export."""
    return checkpoint if opts.fp8 is None else checkpoint.with_name(checkpoint.name + "-fp8")


@contextlib.contextmanager
def _s3(opts: RLOptions, directory: Path) -> Iterator[dict[str, Any] | None]:
    """``--transport s3``: a SeaweedFS server on 127.0.0.1 for the run (stopped after), its
    bucket, and its credentials in this process's environment (the fleet's processes
    inherit them)."""
    if opts.transport != "s3":
        yield None
        return
    from dcr.adapters.s3server import SeaweedServer

    with SeaweedServer(directory / "seaweed") as server:
        saved = dict(os.environ)
        os.environ.update(server.endpoint.environ())
        try:
            bucket = server.endpoint.create_bucket("dcr-rl")
            yield {"bucket": bucket, "prefix": "rl", "endpoint_url": server.endpoint.url,
                   "addressing_style": "path"}  # fmt: skip
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _run_delta(
    opts: RLOptions, directory: Path, checkpoint: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    from dcr.fleet.config import load_fleet
    from dcr.fleet.faults import Fault
    from dcr.fleet.launcher import Launcher
    from dcr.rl.engine import RAY_ENGINE, EngineClient

    ready: Path | str = directory / "run" / "engine-e0.ready.json"
    if opts.backend == "ray":
        ready = f"{RAY_ENGINE}{RAY_NAMESPACE}/rl/e0"  # the engine actor's URL, from Ray
    spec = _spec(opts, directory, checkpoint, ready)
    steps = _Steps(say)
    final: dict[str, Any] = {}
    with _s3(opts, directory) as s3:
        cfg = load_fleet(_fleet_file(opts, spec, checkpoint, directory, s3))
        faults = [
            Fault(version=v, target=t, after=point)
            for v, t, point in (faults_plan(opts.steps) if opts.faults else [])
        ]

        def before_stop() -> None:
            final.update(EngineClient(Path(ready), wait_s=300.0).digest())

        if opts.backend == "ray":
            from dcr.rl.ray import run_on_ray

            report = run_on_ray(cfg, faults, steps.on_event, before_stop, opts.deadline_s, say)
        else:
            launcher = Launcher(cfg, faults=faults, say=say, deadline_s=opts.deadline_s,
                                watch=steps.on_event)  # fmt: skip
            report = launcher.run(before_stop=before_stop)
    killed = [{"step": k["version"], "role": _role(k["process"])} for k in report["sigkills"]]
    return {"rows": steps.rows(opts.steps), "killed": killed, "digest": final, "fleet": report}


def _role(process: str) -> str:
    if process.startswith("engine-"):
        return "engine"
    if process.startswith("o"):
        return "trainer"
    return process


@dataclass(slots=True)
class _Proc:
    popen: subprocess.Popen[bytes]
    group: bool

    def stop(self, grace_s: float) -> None:
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace_s)
        self._signal(signal.SIGKILL)
        self.popen.wait()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.group:
                os.killpg(self.popen.pid, signum)
            elif self.popen.poll() is None:
                self.popen.send_signal(signum)


def _spawn(argv: list[str], log: Path, env: dict[str, str], *, group: bool) -> _Proc:
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHED: "1", **env},
            start_new_session=group,
        )  # fmt: skip
    return _Proc(popen=popen, group=group)


def _run_dense(
    opts: RLOptions, directory: Path, checkpoint: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    from dcr.fleet.trainer import rendezvous_store
    from dcr.rl.engine import EngineClient

    run = directory / "run"
    (run / "logs").mkdir(parents=True)
    ready = run / "engine.ready.json"
    spec = _spec(opts, directory, checkpoint, ready)
    spec_file = run / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    steps = _Steps(say)
    reader = EventReader(run / "events")
    procs: list[_Proc] = []
    world = 2
    store = rendezvous_store("127.0.0.1", world + 1)  # listens on 127.0.0.1 only
    start = time.monotonic()
    try:
        engine_argv = [
            sys.executable, "-m", "dcr.integrations.vllm", "--model",
            str(_served(checkpoint, opts)),
            "--tp", str(opts.tp), "--plain-weights", "--checkpoint-version", "0",
            "--max-model-len", "64", "--no-prefix-cache", "--no-chunked-prefill",
            "--stop-with-parent", "--ready-file", str(ready),
        ]  # fmt: skip
        engine = _spawn(engine_argv, run / "logs" / "engine.log", ENGINE_ENV, group=True)
        procs.append(engine)
        say(f"started the engine (pid {engine.popen.pid}, TP {opts.tp})")
        for rank in range(world):
            argv = [sys.executable, "-m", "dcr.rl.fleet", "--spec", str(spec_file), "--rank",
                    str(rank), "--world", str(world), "--store-port", str(store.port)]  # fmt: skip
            env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
            procs.append(_spawn(argv, run / "logs" / f"rank{rank}.log", env, group=False))
        say(f"started {world} trainer ranks (dense refits: full checkpoints, vLLM's loader)")
        while not steps.done:
            if time.monotonic() - start > opts.deadline_s:
                raise TimeoutError(f"the dense run did not finish within {opts.deadline_s:.0f} s")
            for e in reader.poll():
                steps.on_event(e)
            for i, p in enumerate(procs):
                code = p.popen.poll()
                if code is not None and not (i > 0 and code == 0):
                    name = "the engine" if i == 0 else f"trainer rank {i - 1}"
                    raise ConfigError(f"{name} exited with {code}; see the logs in {run / 'logs'}")
            time.sleep(0.05)
        digest = EngineClient(ready, wait_s=300.0).digest()
    finally:
        for p in reversed(procs):
            p.stop(30.0)
    return {"rows": steps.rows(opts.steps), "killed": [], "digest": digest, "fleet": None}


def run_rl(opts: RLOptions, *, say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run the RL loop; returns ``{"steps": [...], "killed": [...], "final_weights_sha256",
    ...}`` (see ``dcr rl --help``)."""
    from dcr.rl.policy import write_initial_checkpoint

    directory = opts.directory.resolve()
    _fresh(directory)
    checkpoint = directory / "checkpoint-v0"
    write_initial_checkpoint(checkpoint, seed=opts.seed, config=opts.rl)
    say(f"version 0: {checkpoint} ({opts.refit} refits, {opts.mode}, TP {opts.tp}, "
        f"{opts.transport if opts.refit == 'delta' else 'full checkpoints'})")  # fmt: skip
    if opts.fp8 is not None:
        from dcr.models.fp8 import export_checkpoint

        export_checkpoint(checkpoint, _served(checkpoint, opts), opts.fp8)
        say(f"the engine serves FP8 with {opts.fp8.describe()} scales: "
            f"{_served(checkpoint, opts)} (dcr fp8 export of version 0)")  # fmt: skip
    start = time.monotonic()
    runner = _run_delta if opts.refit == "delta" else _run_dense
    out = runner(opts, directory, checkpoint, say)
    return {
        "refit": opts.refit,
        "backend": opts.backend,
        "mode": opts.mode,
        "transport": opts.transport if opts.refit == "delta" else None,
        "tp": opts.tp,
        "rollout_dtype": opts.rollout_dtype,
        "fp8_block": "channel"
        if opts.fp8 is not None and opts.fp8_block is None
        else opts.fp8_block,
        "seed": opts.seed,
        "prompts_per_step": opts.rl.prompts_per_step,
        "group_size": opts.rl.group_size,
        "steps": out["rows"],
        "killed": out["killed"],
        "final_weights_sha256": out["digest"].get("sha256"),
        "seconds": round(time.monotonic() - start, 2),
        **({"ray_start_s": out["fleet"]["ray_start_s"]} if opts.backend == "ray" else {}),
        "directory": str(directory),
    }


def options_with(opts: RLOptions, **changes: Any) -> RLOptions:
    """``opts`` with ``changes`` (for callers that vary one run)."""
    return replace(opts, **changes)
