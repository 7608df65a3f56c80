"""A refit fleet around running vLLM engines, for the engine-integration tests.

* :class:`EngineServer` -- ``python -m dcr.integrations.vllm`` as a subprocess in a process
  group of its own (front end, engine core and workers), reached over its HTTP API, killed
  and stopped by that group's id;
* :func:`write_fleet` -- a fleet file: one rollout node whose receivers are an engine's
  workers, a small trainer layout, short deadlines;
* :class:`Role` -- ``dcr relay`` / ``dcr coordinator`` subprocesses;
* :class:`Trainer` -- every owner of the fleet's training plan in this process (one
  :class:`~dcr.delta.group.LocalTrainingGroup`), publishing the synthetic run's versions;
* :class:`Stream` -- clients sending greedy requests to an engine back to back;
* :class:`ReferenceRuns` -- engines started fresh on each version's checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.faulty import FaultLog, Faults, FaultyTransport
from dcr.delta.group import LocalTrainingGroup
from dcr.engine.owner import OwnerService, TrainingSide, open_owner
from dcr.fleet.config import FleetConfig, free_port, load_fleet
from dcr.fleet.eventlog import EventReader
from dcr.fleet.model import FleetModel
from dcr.fleet.runtime import make_control, make_store, make_transport
from dcr.models.hf import write_checkpoint
from dcr.protocol.types import CommitRecord

HERE = Path(__file__).parent

# Tiny models vLLM's CPU backend runs: head size >= 32, room for prompts longer than two KV
# cache blocks (128 tokens each), so the prefix cache holds whole blocks of them, and for
# requests that outlast a refit on a starved machine (512 bytes of KV cache a token).
OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {"max_position_embeddings": 65536},
    "qwen3_moe": {"max_position_embeddings": 65536},
    "llama": {"head_dim": 32, "max_position_embeddings": 65536},
}


def engine_env() -> dict[str, str]:
    """The environment of every engine process: no CPU binding and one compute thread per
    worker (any core count works, and workers of a TP=2 engine do not spin against each
    other and the rest of the fleet on a small machine), a small KV cache, unbuffered logs.
    Engines under test and reference engines run with the same threads, so their kernels
    reduce in the same order."""
    return dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1",
    )


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def _wait_group_gone(pgid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of group {pgid} outlived it: {group_members(pgid)}")
        time.sleep(0.1)


@dataclass
class EngineServer:
    """One engine process (``python -m dcr.integrations.vllm``) and its HTTP API."""

    popen: subprocess.Popen[bytes]
    ready_file: Path
    log: Path
    url: str = ""

    @classmethod
    def launched(cls, launcher: Any, name: str = "e0") -> EngineServer:
        """The engine ``name`` a fleet :class:`~dcr.fleet.launcher.Launcher` started, once it
        serves."""
        proc = launcher.procs[f"engine-{name}"]
        assert proc.popen is not None
        run = launcher.cfg.run_dir
        return cls(popen=proc.popen, ready_file=run / f"engine-{name}.ready.json",
                   log=run / "logs" / f"engine-{name}.log").wait_ready()  # fmt: skip

    @classmethod
    def start(
        cls,
        directory: Path,
        *,
        model: Path,
        tp: int,
        fleet: Path | None = None,
        receivers: Sequence[str] = (),
        checkpoint_version: int | None = None,
        name: str = "engine",
        plain_weights: bool = True,
        options: Sequence[str] = (),
    ) -> EngineServer:
        """``options``: further command-line options (``--no-prefix-cache``, ...)."""
        directory.mkdir(parents=True, exist_ok=True)
        ready = directory / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "dcr.integrations.vllm", "--model", str(model),
                "--tp", str(tp), "--ready-file", str(ready)]  # fmt: skip
        if plain_weights:
            argv.append("--plain-weights")
        if fleet is not None:
            argv += ["--fleet", str(fleet), "--receivers", ",".join(receivers)]
        if checkpoint_version is not None:
            argv += ["--checkpoint-version", str(checkpoint_version)]
        argv += list(options)
        log = directory / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=engine_env(), start_new_session=True,
            )  # fmt: skip
        return cls(popen=popen, ready_file=ready, log=log)

    def wait_ready(self, timeout_s: float = 240.0) -> EngineServer:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log.read_text(errors="replace")[-4000:]
                raise AssertionError(f"the engine did not start ({self.popen.returncode}):\n{tail}")
            time.sleep(0.2)
        self.url = json.loads(self.ready_file.read_text())["url"]
        return self

    def _call(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method="POST" if data else "GET"
        )
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def request(
        self, path: str, data: bytes | None = None, timeout_s: float = 300.0
    ) -> tuple[int, dict[str, Any]]:
        """``POST`` raw ``data`` to ``path`` (``GET`` when ``None``): the status and the JSON
        answer, error answers included."""
        request = urllib.request.Request(
            self.url + path, data=data, method="GET" if data is None else "POST"
        )
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            with exc:
                body = exc.read()
            try:
                return exc.code, json.loads(body)
            except ValueError:
                return exc.code, {"error": body.decode(errors="replace")}

    def generate_batch(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``POST /generate_batch``: one answer per request, in request order."""
        results: list[dict[str, Any]] = self._call(
            "/generate_batch", {"requests": list(requests)}, timeout_s=600.0
        )["results"]
        return results

    def load(self, checkpoint: Path, version: int) -> dict[str, Any]:
        """``POST /dcr/load``: the engine's weights become the checkpoint's."""
        return self._call(
            "/dcr/load", {"checkpoint": str(checkpoint), "version": version}, timeout_s=600.0
        )

    def digest(self) -> str:
        """``GET /dcr/digest``: SHA-256 of every worker's parameters and buffers."""
        return str(self._call("/dcr/digest", None, timeout_s=120.0)["sha256"])

    def generate(self, prompt: Sequence[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
        body = {"prompt_token_ids": list(prompt), "max_tokens": max_tokens, **kw}
        return self._call("/generate", body, timeout_s=300.0)

    def abort(self, request_id: str) -> None:
        self._call("/abort", {"request_id": request_id}, timeout_s=60.0)

    def stream(self, body: dict[str, Any]) -> Any:
        """``POST /generate`` with ``"stream": true``: the open response (JSON lines)."""
        data = json.dumps({**body, "stream": True}).encode()
        request = urllib.request.Request(self.url + "/generate", data=data, method="POST")
        request.add_header("Content-Type", "application/json")
        return urllib.request.urlopen(request, timeout=600)

    def state(self) -> dict[str, Any]:
        return self._call("/dcr/state", None, timeout_s=60.0)

    def parameters(self) -> dict[str, np.ndarray]:
        """``r<rank>/<name>`` -> integer view of the stored bits, every worker."""
        import base64

        from dcr.tensors.bits import numpy_bits_dtype

        out = {}
        for rank, tensors in enumerate(self._call("/dcr/parameters", None, 120.0)["ranks"]):
            for name, t in tensors.items():
                dtype = numpy_bits_dtype(getattr(torch, t["dtype"]))
                data = np.frombuffer(base64.b64decode(t["bits"]), dtype=dtype)
                out[f"r{rank}/{name}"] = data.reshape(t["shape"])
        return out

    def wait_state(self, check: Any, timeout_s: float = 240.0, what: str = "") -> dict[str, Any]:
        """Poll ``/dcr/state`` until ``check(state)`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if check(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"engine state never reached {what}: {state}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL every process of the engine (front end, engine core, workers)."""
        pgid = self.popen.pid
        if group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
        self.popen.wait()
        _wait_group_gone(pgid)

    def stop(self) -> None:
        """SIGTERM (receivers leave, the engine shuts down), SIGKILL what is left."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(60)
        self.kill()


def write_fleet(
    directory: Path,
    *,
    family: str,
    tp: int,
    sync: bool,
    refits: int,
    rate: float = 0.05,
    model: dict[str, Any] | None = None,
) -> Path:
    """A fleet file: the synthetic ``family`` model (tiny, or with the ``model`` config fields
    on top), a TP=2 trainer, one rollout node whose receivers ``r0..`` are the ranks of one
    engine at tensor parallelism ``tp``."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {**OVERRIDES[family], **(model or {})}
    overrides = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    receivers = ", ".join(f'{{ name = "r{r}", tp = {tp}, rank = {r} }}' for r in range(tp))
    text = f"""[fleet]
name = "engine-{family}"
run_dir = "run"

[model]
family = "{family}"
size_mb = 0
seed = 3
rate = {rate}
refits = {refits}

[model.overrides]
{overrides}
[trainer]
tp = 2
dp = 1
chunk_mb = 0.03125
bucket_mb = 0.0625

[coordinator]
standbys = 0
lease_s = 3.0
join_wait_s = 120
sync = {str(sync).lower()}
timeouts = {{ prepare_s = 60, arrival_s = 60, gate_s = 120, flush_s = 120, commit_s = 5, \
stop_s = 60, baseline_s = 3 }}

[control]                  # generous: engines, trainer and fleet share a small machine
peer_timeout_s = 15

[transport]
peer_timeout_s = 15

[[rollout]]
name = "node0"
port = {free_port()}
receivers = [{receivers}]
"""
    path = directory / "fleet.toml"
    path.write_text(text)
    return path


def write_checkpoints(cfg: FleetConfig, versions: int, directory: Path) -> list[Path]:
    """The synthetic run's versions ``0 .. versions-1`` as checkpoint directories."""
    model = FleetModel(cfg)
    paths = []
    for v in range(versions):
        state = model.run.state(v)
        paths.append(write_checkpoint(directory / f"v{v}", model.config, model.family, state))
    return paths


@dataclass
class Role:
    """A fleet role in its own process (``dcr relay`` / ``dcr coordinator``)."""

    popen: subprocess.Popen[bytes]

    @classmethod
    def start(cls, cfg: FleetConfig, *argv: str) -> Role:
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{argv[0]}.log").open("ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "dcr.cli", argv[0], "--fleet", str(cfg.path), *argv[1:]],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )  # fmt: skip
        return cls(popen=popen)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class Trainer:
    """Every owner of the fleet's plan in this process, at the synthetic run's versions."""

    cfg: FleetConfig
    model: FleetModel
    group: LocalTrainingGroup
    owners: list[OwnerService]
    transports: list[FaultyTransport]
    store: CommitStore
    control: ControlChannel
    records: dict[int, CommitRecord] = field(default_factory=dict)
    candidates: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Versions computed ahead (the optimizer steps), published later."""

    def shards(self, version: int) -> dict[str, torch.Tensor]:
        return synthetic_shards(self.model, version)

    async def compute(self, versions: Sequence[int]) -> None:
        """Compute the trainer's shards at ``versions`` now, so publishing them later only
        stages them (a trainer publishes right after its optimizer step)."""
        for v in versions:
            self.candidates[v] = await anyio.to_thread.run_sync(self.shards, v)

    async def publish(self, version: int, faults: Faults | None = None) -> CommitRecord:
        """Stage ``version`` on every owner and return once it is committed and every
        owner's baseline moved to it.  ``faults`` strike the first attempt (owner o0's
        sends)."""
        if faults is not None:
            self.transports[0].arm(faults, FaultLog())
        candidate = self.candidates.pop(version, None)
        if candidate is None:
            candidate = await anyio.to_thread.run_sync(self.shards, version)
        await anyio.to_thread.run_sync(self.group.stage, candidate)
        for owner in self.owners:
            await owner.staged(True)
        with anyio.move_on_after(300) as waited:
            while any(o.core.baseline.version < version for o in self.owners):
                await anyio.sleep(0.05)
        if waited.cancelled_caught:
            baselines = {o.core.name: o.core.baseline for o in self.owners}
            raise AssertionError(f"version {version} not committed in 300 s: {baselines}")
        for t in self.transports:
            t.arm(Faults(), FaultLog())
        record = self.owners[0].core.baseline
        self.records[version] = record
        return record


def synthetic_shards(model: FleetModel, version: int) -> dict[str, torch.Tensor]:
    """Every training shard of the fleet's plan at ``version`` of the synthetic run."""
    return {s.key: model.run.shard(s, version) for s in model.plan.shards}


async def open_trainer(cfg: FleetConfig, stack: AsyncExitStack) -> Trainer:
    model = FleetModel(cfg)
    store = make_store(cfg)
    stack.push_async_callback(store.close)
    control = make_control(cfg, store)
    stack.push_async_callback(control.aclose)
    record = (await store.read()).record
    integration = model.integration()
    group = LocalTrainingGroup(model.plan, synthetic_shards(model, 0), config=model.build)
    side = TrainingSide(group, integration.xor_names)
    transports = []
    owners = []
    for name, rank in integration.owner_ids.items():
        transport = FaultyTransport(make_transport(cfg))
        stack.push_async_callback(transport.inner.aclose)
        transports.append(transport)
        owner = open_owner(
            name=name, rank=rank, side=side, integration=integration, control=control,
            transport=transport, store=store, baseline=record, sends_in_flight=4,
        )  # fmt: skip
        owners.append(await stack.enter_async_context(owner))
    trainer = Trainer(cfg=cfg, model=model, group=group, owners=owners, transports=transports,
                      store=store, control=control)  # fmt: skip
    trainer.records[0] = record
    return trainer


@dataclass
class Stream:
    """``clients`` clients sending greedy requests to an engine back to back; every answer
    (with its weight versions) is kept, with the time its request was sent."""

    server: EngineServer
    clients: int = 2
    max_tokens: int = 48
    seed: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: anyio.Event | None = None
    _done: anyio.Event | None = None

    async def _client(self, index: int, rng: random.Random) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            # Stream prompts start with tokens the fixed prompts never use first.
            prompt = [rng.randrange(100, 240) for _ in range(rng.randrange(4, 16))]
            sent = time.time()
            try:
                out = await anyio.to_thread.run_sync(self.server.generate, prompt, self.max_tokens)
            except (urllib.error.URLError, OSError) as exc:
                self.failures.append(f"client {index}: {exc}")
                return
            self.results.append({**out, "sent": sent, "received": time.time()})

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._stop, self._done = anyio.Event(), anyio.Event()
        rng = random.Random(self.seed)
        self.seed += 1
        try:
            async with anyio.create_task_group() as tg:
                for i in range(self.clients):
                    tg.start_soon(self._client, i, random.Random(rng.random()))
                task_status.started()
        finally:
            self._done.set()

    async def stop(self) -> None:
        """Let the requests in flight finish; send no more."""
        assert self._stop is not None and self._done is not None
        self._stop.set()
        await self._done.wait()


@dataclass
class LongRequest:
    """One request streamed from an engine: the tokens it has so far, then its answer."""

    server: EngineServer
    request_id: str
    prompt: list[int]
    max_tokens: int
    tokens: int = 0
    result: dict[str, Any] | None = None
    sent: float = 0.0

    def _read(self) -> None:
        self.sent = time.time()
        body = {"prompt_token_ids": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "request_id": self.request_id}  # fmt: skip
        with self.server.stream(body) as response:
            for line in response:
                message = json.loads(line)
                if "tokens" in message:
                    self.tokens = int(message["tokens"])
                else:
                    self.result = {**message["result"], "sent": self.sent,
                                   "received": time.time()}  # fmt: skip

    async def run(self) -> None:
        await anyio.to_thread.run_sync(self._read)

    async def wait_tokens(self, n: int, timeout_s: float = 120.0) -> int:
        """Wait until the request has at least ``n`` output tokens; returns how many."""
        with anyio.fail_after(timeout_s):
            while self.tokens < n:
                if self.result is not None:
                    raise AssertionError(f"{self.request_id} ended with {self.tokens} tokens")
                await anyio.sleep(0.01)
        return self.tokens


def fixed_prompts() -> list[list[int]]:
    """The prompts checked after every commit; the last spans more than two KV cache blocks,
    so a prefix cache holding blocks computed with older weights would change its output."""
    rng = random.Random(11)
    return [
        [1, 2, 3, 4, 5],
        [1, *(rng.randrange(5, 240) for _ in range(23))],
        [1, *(rng.randrange(5, 240) for _ in range(269))],
    ]


@dataclass
class ReferenceRuns:
    """Fresh engines on each checkpoint at tensor parallelism ``tp`` (one process per rank,
    one engine at a time), running in the background: each one's parameters
    (``r<rank>/<name>``) and the fixed prompts' greedy generations."""

    directory: Path
    versions: int
    tp: int
    procs: list[subprocess.Popen[bytes]]

    @classmethod
    def start(
        cls, directory: Path, checkpoints: Sequence[Path], *, tp: int, max_tokens: int
    ) -> ReferenceRuns:
        directory.mkdir(parents=True, exist_ok=True)
        prompts = directory / "prompts.json"
        prompts.write_text(json.dumps(fixed_prompts()))
        ports = ",".join(str(free_port()) for _ in checkpoints)
        argv = [sys.executable, str(HERE / "reference_engine.py"), "--out", str(directory),
                "--prompts", str(prompts), "--max-tokens", str(max_tokens), "--ports", ports,
                *map(str, checkpoints)]  # fmt: skip
        procs = []
        for rank in range(tp):
            env = dict(engine_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp),
                       MASTER_ADDR="127.0.0.1", VLLM_ENABLE_V1_MULTIPROCESSING="0")  # fmt: skip
            with (directory / f"reference-r{rank}.log").open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        return cls(directory=directory, versions=len(checkpoints), tp=tp, procs=procs)

    def result(self) -> list[tuple[dict[str, np.ndarray], list[dict[str, Any]]]]:
        """Wait for every engine; raises with the logs when one failed."""
        try:
            codes = [p.wait(timeout=900) for p in self.procs]
        finally:
            self.stop()
        if any(codes):
            logs = "".join(
                (self.directory / f"reference-r{r}.log").read_text()[-3000:] for r in range(self.tp)
            )
            raise AssertionError(f"reference engines failed ({codes}):\n{logs}")
        runs = []
        for i in range(self.versions):
            params = {}
            for rank in range(self.tp):
                with np.load(self.directory / f"ref-{i}-r{rank}.npz") as f:
                    params.update({f"r{rank}/{k}": f[k] for k in f.files})
            runs.append((params, json.loads((self.directory / f"ref-{i}.json").read_text())))
        return runs

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            _wait_group_gone(p.pid)


def bit_mismatches(mine: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> list[str]:
    """Names whose dtype, shape or any stored bit differ (both ways)."""
    bad = sorted(set(mine) ^ set(ref))
    for name in sorted(set(mine) & set(ref)):
        a, b = mine[name], ref[name]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            bad.append(name)
    return bad


def same_floats(a: Sequence[float], b: Sequence[float]) -> bool:
    """Bit-for-bit equality of two float sequences (as float64 words)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return x.shape == y.shape and np.array_equal(x.view(np.int64), y.view(np.int64))


def _tail(path: Path, lines: int, width: int = 300) -> list[str]:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return [f"({exc})"]
    return [line[:width] for line in text]


def fleet_snapshot(cfg: FleetConfig, engines: Sequence[EngineServer]) -> str:
    """What a failed end-to-end run was doing: the last events of every fleet process, the
    role logs' and engine logs' tails and each live engine's state (printed on failure)."""
    out = ["-- fleet snapshot --"]
    for path in sorted(cfg.events_dir.glob("*.jsonl")):
        out += [f"{path.name}:", *("  " + line for line in _tail(path, 6))]
    for path in sorted((cfg.run_dir / "logs").glob("*.log")):
        out += [f"{path.name}:", *("  " + line for line in _tail(path, 10))]
    for engine in engines:
        out += [f"{engine.log.name} (exit {engine.popen.poll()}):"]
        out += ["  " + line for line in _tail(engine.log, 15)]
        if engine.popen.poll() is None and engine.url:
            try:
                out.append(f"  state: {json.dumps(engine.state())[:1500]}")
            except (OSError, ValueError) as exc:
                out.append(f"  state: ({exc!r})")
    return "\n".join(out)


def coordinator_events(cfg: FleetConfig) -> list[dict[str, Any]]:
    reader = EventReader(cfg.events_dir)
    return [e for e in reader.poll() if e["who"] == "coordinator"]


def load(path: Path) -> FleetConfig:
    return load_fleet(path)
