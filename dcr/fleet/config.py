"""The fleet file: one TOML file that describes every process of a refit fleet.

Every role (``dcr coordinator``, ``dcr owner``, ``dcr receiver``, ``dcr relay``) and the
launcher (``dcr fleet``) read the same file, so a fleet runs on one host or many with the
same description.  Adapters are chosen by their registered names (``commit_store.kind``,
``control.kind``, ``transport.kind``).  A minimal file::

    [fleet]
    run_dir = "run"                # sqlite file, per-process logs and event files

    [model]                        # the synthetic model the demo trainer trains
    family = "llama"
    size_mb = 300
    rate = 0.01
    refits = 5

    [trainer]
    tp = 2
    dp = 2

    [queue]                        # every receiver's bounded apply queue (optional)
    groups = 32
    group_size = 8

    [proof]                        # proof of the base version (optional; on by default)
    samples = 64                   # sampled positions per tensor at every prepare
    fingerprint_on_join = true     # complete fingerprint when receivers start or restore
    fingerprint_each_commit = false

    [[rollout]]                    # one rollout node: a relay node and its receivers
    name = "node0"
    receivers = [{ name = "r0", tp = 1, rank = 0 }]

    [[rollout]]
    name = "node1"
    receivers = [{ name = "r1", tp = 2, rank = 0 }, { name = "r2", tp = 2, rank = 1 }]

Relative paths are relative to the fleet file.  Ports left at 0 are chosen by the launcher
and written to ``<run_dir>/ports.json``, which every role reads.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError
from dcr.ports import free_port, free_ports
from dcr.protocol.proof import ProofConfig
from dcr.protocol.receiver import QueueConfig
from dcr.protocol.types import Timeouts

__all__ = [
    "CoordinatorSection",
    "EngineSection",
    "FleetConfig",
    "ModelSection",
    "ReceiverSpec",
    "RolloutNode",
    "TrainerSection",
    "free_port",
    "free_ports",
    "load_fleet",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The synthetic model (:class:`~dcr.models.synthetic.SyntheticRun`) the trainer trains."""

    family: str = "llama"
    size_mb: float = 300.0
    """Checkpoint size in MB of bf16; the layer count is chosen to reach it."""
    seed: int = 0
    rate: float = 0.01
    """Fraction of elements each optimizer step updates."""
    rates: tuple[float, ...] = ()
    """Per-step rates instead of ``rate``: step ``k`` updates ``rates[(k - 1) % len(rates)]``
    of the elements (a benchmark measures several rates in one run)."""
    refits: int = 5
    """Optimizer steps the trainer publishes."""
    preloaded: bool = False
    """Receivers start holding version 0, loaded through their own native loader as an engine
    started from the first checkpoint would, instead of starting empty and restoring it by a
    dense refit over the transport (benchmarks that time refits of a large model skip that
    restore)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """HF config fields that replace the generated ones (e.g. a tiny model for tests)."""
    checkpoint: str | None = None
    """A Hugging Face checkpoint directory (relative to the fleet file) that gives the model
    instead of ``family``, ``size_mb`` and ``overrides``: the catalog (names, shapes, dtypes)
    from its safetensors headers (:func:`dcr.catalog.read_catalog`), the config from its
    ``config.json``.  The synthetic trainer trains synthetic weights of that catalog."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSection:
    """The trainer's parallel layout and construction settings; one owner process per rank."""

    tp: int = 2
    ep: int = 1
    dp: int = 2
    chunk_mb: float = 8.0
    bucket_mb: float = 16.0
    build_threads: int = 0
    """Worker threads each owner process compares blocks on; 0: the CPUs the process may
    run on (its affinity mask).  With 1, an owner scans in its own thread and does not
    overlap the scan of one bucket with the encoding of the one before."""
    sends_in_flight: int = 4
    timeout_s: float = 120.0
    """torch.distributed collective timeout of the trainer's process group."""
    lockstep: bool = False
    """Each rank publishes step ``k`` only once every rank computed it and the launcher
    checked version ``k - 1`` on every receiver (``<run_dir>/go.json``), so that no
    optimizer step and no check runs beside a refit (benchmarks time refits this way)."""

    def __post_init__(self) -> None:
        threads = self.build_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"build_threads must be an integer >= 0, got {self.build_threads!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverSpec:
    """One serving rank: its name and where it sits in its engine's tensor parallelism."""

    name: str
    tp: int = 1
    rank: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutNode:
    """One rollout host: a relay node of the tree and the receivers it hosts."""

    name: str
    receivers: tuple[ReceiverSpec, ...]
    port: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSection:
    """A vLLM engine whose workers are receivers of the fleet (``[[engine]]``).

    The launcher starts it as ``python -m dcr.integrations.vllm`` instead of one ``dcr
    receiver`` process per rank, supervises it as one process group and checks its ranks by
    the fingerprint of their stored bits (:mod:`dcr.integrations.vllm`).
    """

    name: str
    receivers: tuple[str, ...]
    """The receiver of each worker rank, in rank order (declared in ``[[rollout]]`` as ranks
    ``0 .. n-1`` of ``tp = n`` on one node)."""
    model: str | None = None
    """The checkpoint directory the engine serves (relative to the fleet file); default the
    ``[model] checkpoint``."""
    checkpoint_version: int | None = None
    """The version whose checkpoint ``model`` is: when it is the committed one at start, the
    engine joins serving; otherwise (``None``) its ranks first restore the committed version
    by dense refit."""
    plain_weights: bool = False
    """CPU engines: keep the weights plain (``load_format="dcr_plain"``) so in-place refit is
    exact."""
    dtype: str = "bfloat16"
    max_model_len: int | None = None
    pause_mode: str | None = None
    """How the request gate pauses the engine (``wait``, ``keep``, ``abort``); default: as
    each attempt's RL mode wants."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of the engine process on top of the launcher's (e.g.
    ``VLLM_CPU_KVCACHE_SPACE``)."""
    stop_s: float = 60.0
    """How long a stopping engine may take to shut down before its process group is
    killed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSection:
    """The coordinator process and its standbys."""

    standbys: int = 1
    lease_s: float = 3.0
    """A standby takes over once the active coordinator has not renewed its lease this long."""
    dense_timeout_s: float = 120.0
    """A dense refit of a joining receiver that did not finish by then is sent again."""
    join_wait_s: float = 60.0
    """Before a transition starts, how long to wait for receivers that are still starting or
    restoring the committed version, so that they take part instead of joining later."""
    sync: bool = True
    timeouts: Timeouts = field(
        default_factory=lambda: Timeouts(
            prepare_s=30.0,
            arrival_s=120.0,
            gate_s=60.0,
            flush_s=300.0,
            commit_s=5.0,
            stop_s=60.0,
            baseline_s=3.0,
        )
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """Everything the fleet file says, with defaults filled in."""

    path: Path
    run_dir: Path
    name: str = "fleet"
    host: str = "127.0.0.1"
    model: ModelSection = field(default_factory=ModelSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    rollout: tuple[RolloutNode, ...] = ()
    engines: tuple[EngineSection, ...] = ()
    """vLLM engines hosting receivers (``[[engine]]``); the other receivers run as ``dcr
    receiver`` processes."""
    coordinator: CoordinatorSection = field(default_factory=CoordinatorSection)
    queue: QueueConfig = field(default_factory=QueueConfig)
    """Every receiver's bounded apply queue (``[queue]``: ``groups``, ``group_size``)."""
    proof: ProofConfig | None = field(default_factory=ProofConfig)
    """Proof of the base version (``[proof]``: ``samples``, ``fingerprint_on_join``,
    ``fingerprint_each_commit``; ``enabled = false`` turns it off): a seeded sample at every
    prepare, the complete fingerprint when receivers started, restarted or were restored."""
    commit_store: dict[str, Any] = field(default_factory=lambda: {"kind": "sqlite"})
    control: dict[str, Any] = field(default_factory=lambda: {"kind": "zmq"})
    transport: dict[str, Any] = field(default_factory=lambda: {"kind": "relay", "fanout": 2})

    @property
    def receivers(self) -> tuple[ReceiverSpec, ...]:
        return tuple(r for node in self.rollout for r in node.receivers)

    def node_of(self, receiver: str) -> RolloutNode:
        for node in self.rollout:
            if any(r.name == receiver for r in node.receivers):
                return node
        raise ConfigError(f"no rollout node hosts receiver {receiver!r}")

    def engine_of(self, receiver: str) -> EngineSection | None:
        """The ``[[engine]]`` whose worker is ``receiver``, if one is."""
        return next((e for e in self.engines if receiver in e.receivers), None)

    def receiver(self, name: str) -> ReceiverSpec:
        for r in self.receivers:
            if r.name == name:
                return r
        raise ConfigError(f"the fleet file names no receiver {name!r}")

    @property
    def world_size(self) -> int:
        t = self.trainer
        return t.tp * t.ep * t.dp

    @property
    def owners(self) -> tuple[str, ...]:
        return tuple(f"o{rank}" for rank in range(self.world_size))

    @property
    def ports_file(self) -> Path:
        return self.run_dir / "ports.json"

    @property
    def events_dir(self) -> Path:
        return self.run_dir / "events"

    def store_path(self) -> Path:
        return self.run_dir / str(self.commit_store.get("path", "commit.db"))

    def ports(self) -> dict[str, int]:
        """Relay ports by node name: the fleet file's, or the launcher's choice."""
        chosen = {n.name: n.port for n in self.rollout}
        if self.ports_file.exists():
            written = json.loads(self.ports_file.read_text())
            chosen.update({k: int(v) for k, v in written.items() if not chosen.get(k)})
        missing = [k for k, v in chosen.items() if not v]
        if missing:
            raise ConfigError(f"no port for relay nodes {missing}: start it with `dcr fleet`")
        return chosen

    def address(self, node: str) -> str:
        return f"tcp://{self.host}:{self.ports()[node]}"


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"[{where}] has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc


def _model(raw: Any, base: Path) -> ModelSection:
    """``[model]``, its ``rates`` as a tuple and its ``checkpoint`` relative to ``base``."""
    model: ModelSection = _section(ModelSection, raw, "model")
    if not isinstance(model.rates, tuple):
        if not isinstance(model.rates, list):
            raise ConfigError("[model] rates must be a list of numbers")
        model = replace(model, rates=tuple(model.rates))
    if model.checkpoint is not None:
        if not isinstance(model.checkpoint, str) or not model.checkpoint:
            raise ConfigError("[model] checkpoint must be the path of a checkpoint directory")
        given = sorted({"family", "size_mb", "overrides"} & set(raw))
        if given:
            raise ConfigError(f"[model] checkpoint gives the model: leave out {given}")
        model = replace(model, checkpoint=str(base / model.checkpoint))
    return model


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and check a fleet file; raises :class:`ConfigError` naming what is wrong."""
    path = Path(path).resolve()
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read fleet file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    top = raw.get("fleet", {})
    allowed = {"fleet", "model", "trainer", "rollout", "engine", "coordinator", "queue",
               "commit_store", "control", "transport", "proof"}  # fmt: skip
    if set(raw) - allowed:
        raise ConfigError(f"{path}: unknown sections {sorted(set(raw) - allowed)}")
    coord_raw = dict(raw.get("coordinator", {}))
    timeouts = coord_raw.pop("timeouts", None)
    coordinator = _section(CoordinatorSection, coord_raw, "coordinator")
    if timeouts is not None:
        coordinator = CoordinatorSection(
            **{f.name: getattr(coordinator, f.name) for f in fields(CoordinatorSection)
               if f.name != "timeouts"},
            timeouts=_section(Timeouts, timeouts, "coordinator.timeouts"),
        )  # fmt: skip
    nodes = []
    for i, node in enumerate(raw.get("rollout", [])):
        receivers = tuple(
            _section(ReceiverSpec, r, f"rollout.{i}.receivers") for r in node.get("receivers", [])
        )
        rest = {k: v for k, v in node.items() if k != "receivers"}
        nodes.append(_section(RolloutNode, {**rest, "receivers": receivers}, f"rollout.{i}"))
    run_dir = path.parent / str(top.get("run_dir", "run"))
    proof_raw = raw.get("proof", {})
    if not isinstance(proof_raw, dict):
        raise ConfigError("[proof] must be a table")
    proof_raw = dict(proof_raw)
    enabled = proof_raw.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"[proof] enabled must be true or false, got {enabled!r}")
    proof = _section(ProofConfig, proof_raw, "proof") if enabled else None
    cfg = FleetConfig(
        path=path,
        run_dir=run_dir,
        name=str(top.get("name", path.stem)),
        host=str(top.get("host", "127.0.0.1")),
        model=_model(raw.get("model"), path.parent),
        trainer=_section(TrainerSection, raw.get("trainer"), "trainer"),
        rollout=tuple(nodes),
        engines=_engines(raw.get("engine", []), path.parent),
        coordinator=coordinator,
        queue=_section(QueueConfig, raw.get("queue"), "queue"),
        proof=proof,
        commit_store={"kind": "sqlite", **raw.get("commit_store", {})},
        control={"kind": "zmq", **raw.get("control", {})},
        transport=_transport(raw.get("transport", {})),
    )
    _check(cfg)
    return cfg


def _transport(raw: Any) -> dict[str, Any]:
    """``[transport]`` with its defaults: the relay tree of fan-out 2 unless a kind is named
    (an object store's keys are its own)."""
    if not isinstance(raw, dict):
        raise ConfigError("[transport] must be a table")
    if raw.get("kind", "relay") == "relay":
        return {"kind": "relay", "fanout": 2, **raw}
    return dict(raw)


def _engines(raw: Any, base: Path) -> tuple[EngineSection, ...]:
    """``[[engine]]`` tables, their ``receivers`` as tuples and ``model`` relative to ``base``."""
    if not isinstance(raw, list):
        raise ConfigError("[[engine]] must be an array of tables")
    engines = []
    for i, table in enumerate(raw):
        engine: EngineSection = _section(EngineSection, table, f"engine.{i}")
        names = engine.receivers
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"[[engine]] {engine.name!r}: receivers must be a list of names")
        if not isinstance(engine.env, dict):
            raise ConfigError(f"[[engine]] {engine.name!r}: env must be a table of strings")
        model = None if engine.model is None else str(base / engine.model)
        engines.append(replace(engine, receivers=tuple(names), model=model,
                               env={str(k): str(v) for k, v in engine.env.items()}))  # fmt: skip
    return tuple(engines)


def _check_engines(cfg: FleetConfig) -> None:
    names = [e.name for e in cfg.engines]
    if len(set(names)) != len(names):
        raise ConfigError(f"{cfg.path}: engine names must be unique")
    hosted = [r for e in cfg.engines for r in e.receivers]
    if len(set(hosted)) != len(hosted):
        raise ConfigError(f"{cfg.path}: a receiver can be a worker of one engine only")
    for e in cfg.engines:
        where = f"[[engine]] {e.name!r}"
        if not e.receivers:
            raise ConfigError(f"{where}: receivers must name one receiver per worker rank")
        if e.model is None and cfg.model.checkpoint is None:
            raise ConfigError(f"{where}: model (or [model] checkpoint) names what it serves")
        layout = [(cfg.receiver(r).tp, cfg.receiver(r).rank) for r in e.receivers]
        workers = len(e.receivers)
        if layout != [(workers, rank) for rank in range(workers)]:
            raise ConfigError(
                f"{where}: receivers {list(e.receivers)} must be declared as ranks 0..{workers - 1}"
                f" of tp={workers}, in that order; they are (tp, rank) {layout}"
            )
        if len({cfg.node_of(r).name for r in e.receivers}) != 1:
            raise ConfigError(f"{where}: its receivers must be on one [[rollout]] node")
        if e.pause_mode not in (None, "wait", "keep", "abort"):
            raise ConfigError(f"{where}: pause_mode must be wait, keep or abort")


def _check(cfg: FleetConfig) -> None:
    if not cfg.rollout:
        raise ConfigError(f"{cfg.path}: at least one [[rollout]] node is needed")
    names = [r.name for r in cfg.receivers]
    if len(set(names)) != len(names) or not names:
        raise ConfigError(f"{cfg.path}: receiver names must be unique and at least one given")
    for r in cfg.receivers:
        if not 0 <= r.rank < r.tp:
            raise ConfigError(f"receiver {r.name}: rank {r.rank} outside tp={r.tp}")
    if len({n.name for n in cfg.rollout}) != len(cfg.rollout):
        raise ConfigError(f"{cfg.path}: rollout node names must be unique")
    if cfg.model.refits < 1 or not all(0 < r <= 1 for r in (cfg.model.rate, *cfg.model.rates)):
        raise ConfigError("[model] needs refits >= 1 and every rate in (0, 1]")
    _check_engines(cfg)
