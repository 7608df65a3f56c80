"""The fleet file: one TOML file that describes every process of a refit fleet.

Every role (``dcr coordinator``, ``dcr owner``, ``dcr receiver``, ``dcr relay``) and the
launcher (``dcr fleet``) read the same file, so a fleet runs on one host or many with the
same description.  Adapters are chosen by their registered names (``commit_store.kind``,
``control.kind``, ``transport.kind``).  A minimal file::

    [fleet]
    run_dir = "run"                # sqlite file, per-process logs and event files
    keys = "keys"                  # key directory (`dcr keys init keys --fleet FILE`)

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

This module holds :class:`FleetConfig` and :func:`load_fleet`, which reads and checks a file;
the dataclasses of its sections are in :mod:`dcr.fleet.sections`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dcr.adapters.security import COORDINATOR, Identity, KeyDir, Security, is_loopback
from dcr.adapters.security.keys import KEYRING
from dcr.errors import ConfigError
from dcr.fleet.sections import (
    CoordinatorSection,
    EngineSection,
    MetricsSection,
    ModelSection,
    RaySection,
    ReceiverSpec,
    RolloutNode,
    TrainerSection,
)
from dcr.ports import free_port, free_ports
from dcr.protocol.proof import ProofConfig
from dcr.protocol.receiver import QueueConfig
from dcr.protocol.types import Timeouts

__all__ = [
    "FleetConfig",
    "free_port",
    "free_ports",
    "load_fleet",
]


RELAY_PORT_WAIT_S = 30.0
"""How long a process waits for a relay node started by hand to record its port."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """Everything the fleet file says, with defaults filled in."""

    path: Path
    run_dir: Path
    name: str = "fleet"
    host: str = "127.0.0.1"
    keys: Path | None = None
    """The fleet's key directory (``[fleet] keys``, made by ``dcr keys init``): CURVE on the
    control channel and the relay tree, keyed payload and manifest seals.  ``None``: no
    authentication or encryption, so every socket binds loopback only unless ``insecure``."""
    insecure: bool = False
    """``[fleet] insecure = true``: bind a non-loopback ``host`` without keys (warned at every
    start).  Anyone who reaches such a port can then send and read weights."""
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
    ray: RaySection = field(default_factory=RaySection)
    """Placement on a Ray cluster (``[ray]``): only :mod:`dcr.ray` reads it."""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Per-refit metrics of every process (``[metrics]``: ``port``, ``host``, ``ray``)."""
    relay_addresses: dict[str, str] = field(default_factory=dict)
    """Relay node -> its address, where something other than the fleet file and ``host``
    knows it (Ray: each node binds its own IP and its actor names the address)."""

    @property
    def receivers(self) -> tuple[ReceiverSpec, ...]:
        return tuple(r for node in self.rollout for r in node.receivers)

    def security(self) -> Security:
        """The fleet's key material as its processes use it (read from :attr:`keys`)."""
        return Security(KeyDir(self.keys) if self.keys is not None else None, self.insecure)

    def ensure_keys(self) -> list[Identity]:
        """Make :attr:`keys` when it does not exist yet, or give the identities it lacks key
        pairs (a fleet on one host; across hosts, make and copy keys with ``dcr keys``).
        Returns the identities that got new key pairs."""
        if self.keys is None:
            return []
        wanted = self.identities()
        if not (self.keys / KEYRING).exists():
            KeyDir.init(self.keys, wanted)
            return wanted
        return KeyDir(self.keys).add(wanted)

    def identities(self) -> list[Identity]:
        """Every identity the fleet's processes use: the coordinator, one owner per trainer
        rank, every receiver and every rollout node's relay node."""
        return [
            COORDINATOR,
            *(Identity("owner", o) for o in self.owners),
            *(Identity("receiver", r.name) for r in self.receivers),
            *(Identity("relay", n.name) for n in self.rollout),
        ]

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
        return self.trainer.world_size

    @property
    def owners(self) -> tuple[str, ...]:
        """Owner names, one per trainer rank: ``o0 .. o{ranks-1}``."""
        return tuple(f"o{rank}" for rank in range(self.world_size))

    @property
    def owner_ids(self) -> dict[str, int]:
        """Owner name -> the owner id its payload headers carry (its rank)."""
        return {owner: rank for rank, owner in enumerate(self.owners)}

    @property
    def ports_file(self) -> Path:
        return self.run_dir / "ports.json"

    @property
    def events_dir(self) -> Path:
        return self.run_dir / "events"

    def store_path(self) -> Path:
        return self.run_dir / str(self.commit_store.get("path", "commit.db"))

    def recorded_ports(self) -> dict[str, int]:
        """Relay ports chosen at run time (``<run_dir>/ports.json``): by the launcher, or by
        a relay node started by hand with ``port = 0``."""
        try:
            written = json.loads(self.ports_file.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(written, dict):
            return {}
        return {str(k): int(v) for k, v in written.items() if isinstance(v, int) and v > 0}

    def ports(self, *, wait_s: float = 0.0) -> dict[str, int]:
        """Relay ports by node name: the fleet file's, else the one recorded at run time.

        A node whose port is 0 and not recorded yet is waited for up to ``wait_s`` seconds
        (its ``dcr relay`` may still be starting); then :class:`ConfigError` says what to do.
        """
        deadline = time.monotonic() + wait_s
        while True:
            chosen = {n.name: n.port for n in self.rollout}
            recorded = self.recorded_ports()
            chosen.update({k: v for k, v in recorded.items() if not chosen.get(k)})
            missing = [k for k, v in chosen.items() if not v]
            if not missing:
                return chosen
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"relay nodes {missing} have port = 0 and no running `dcr relay` recorded "
                    f"the port it bound in {self.ports_file}: start `dcr relay --fleet "
                    f"{self.path} --node {missing[0]}` first (ports chosen at run time are "
                    "found on this host only; across hosts give each [[rollout]] a port)",
                    check="port",
                )
            time.sleep(0.2)

    def address(self, node: str) -> str:
        """The relay address of rollout node ``node`` (waits briefly for a port chosen at
        run time)."""
        if node in self.relay_addresses:
            return self.relay_addresses[node]
        return f"tcp://{self.host}:{self.ports(wait_s=RELAY_PORT_WAIT_S)[node]}"

    def record_port(self, node: str, port: int) -> None:
        """Record the port relay node ``node`` bound (``ports.json``, merged, atomically)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ports = {**self.recorded_ports(), node: int(port)}
        tmp = self.ports_file.with_name(f"{self.ports_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(ports))
        os.replace(tmp, self.ports_file)


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


def _model(raw: Any, base: Path, trainer: TrainerSection) -> ModelSection:
    """``[model]``, its ``rates`` as a tuple and its ``checkpoint`` relative to ``base``.

    Only the synthetic trainer trains ``[model]``; with another trainer the section may only
    name the ``checkpoint`` whose catalog the fleet serves (or be left out)."""
    if not trainer.synthetic and isinstance(raw, dict):
        extra = sorted(set(raw) - {"checkpoint", "rollout_dtype", "fp8_block"})
        if extra:
            raise ConfigError(
                f"[model] keys {extra} describe the synthetic trainer's model; trainer "
                f"{trainer.kind!r} trains its own (only [model] checkpoint may be given: the "
                "checkpoint whose tensors the fleet serves)"
            )
    model: ModelSection = _section(ModelSection, raw, "model")
    if not isinstance(model.rates, tuple):
        if not isinstance(model.rates, list):
            raise ConfigError("[model] rates must be a list of numbers")
        model = replace(model, rates=tuple(model.rates))
    if model.rollout_dtype not in ("bf16", "fp8"):
        raise ConfigError(f"[model] rollout_dtype must be 'bf16' or 'fp8', got "
                          f"{model.rollout_dtype!r}")  # fmt: skip
    block = model.fp8_block
    if block != "channel" and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ConfigError(f"[model] fp8_block must be a positive integer or 'channel', got "
                          f"{block!r}")  # fmt: skip
    if model.checkpoint is not None:
        if not isinstance(model.checkpoint, str) or not model.checkpoint:
            raise ConfigError("[model] checkpoint must be the path of a checkpoint directory")
        given = sorted({"family", "size_mb", "overrides"} & set(raw))
        if given:
            raise ConfigError(f"[model] checkpoint gives the model: leave out {given}")
        model = replace(model, checkpoint=str(base / model.checkpoint))
    return model


def fleet_secret_of(cfg: FleetConfig) -> bytes | None:
    """The fleet secret of ``cfg``'s key directory (``None``: the fleet has no keys)."""
    keys = cfg.security().keys
    return keys.secret() if keys is not None else None


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
    if not isinstance(top, dict):
        raise ConfigError("[fleet] must be a table")
    keys = top.get("keys")
    if keys is not None and (not isinstance(keys, str) or not keys):
        raise ConfigError(f"[fleet] keys must name a key directory, got {keys!r}")
    insecure = top.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"[fleet] insecure must be true or false, got {insecure!r}")
    allowed = {"fleet", "model", "trainer", "rollout", "engine", "coordinator", "queue",
               "commit_store", "control", "transport", "proof", "ray", "metrics"}  # fmt: skip
    if set(raw) - allowed:
        raise ConfigError(f"{path}: unknown sections {sorted(set(raw) - allowed)}")
    coord_raw = dict(raw.get("coordinator", {}))
    timeouts = coord_raw.pop("timeouts", None)
    coordinator = _section(CoordinatorSection, coord_raw, "coordinator")
    if timeouts is not None:
        coordinator = CoordinatorSection(
            **{f.name: getattr(coordinator, f.name) for f in fields(CoordinatorSection)
               if f.name != "timeouts"},
            # A partial table changes only the deadlines it names (the fleet's defaults stay).
            timeouts=_section(
                Timeouts,
                {**asdict(CoordinatorSection().timeouts), **timeouts}
                if isinstance(timeouts, dict) else timeouts,
                "coordinator.timeouts",
            ),
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
    trainer: TrainerSection = _section(TrainerSection, raw.get("trainer"), "trainer")
    engines = _engines(raw.get("engine", []), path.parent)
    cfg = FleetConfig(
        path=path,
        run_dir=run_dir,
        name=str(top.get("name", path.stem)),
        host=str(top.get("host", "127.0.0.1")),
        keys=None if keys is None else path.parent / keys,
        insecure=insecure,
        model=_model(raw.get("model"), path.parent, trainer),
        trainer=trainer,
        rollout=_runtimes(tuple(nodes), engines),
        engines=engines,
        coordinator=coordinator,
        queue=_section(QueueConfig, raw.get("queue"), "queue"),
        proof=proof,
        commit_store={"kind": "sqlite", **raw.get("commit_store", {})},
        control={"kind": "zmq", **raw.get("control", {})},
        transport=_transport(raw.get("transport", {})),
        ray=_section(RaySection, raw.get("ray"), "ray"),
        metrics=_metrics(raw.get("metrics")),
    )
    _check(cfg)
    return cfg


def _metrics(raw: Any) -> MetricsSection:
    """``[metrics]``; a ``port`` needs ``prometheus_client`` (the ``metrics`` extra)."""
    section: MetricsSection = _section(MetricsSection, raw, "metrics")
    if section.port and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"[metrics] port = {section.port} serves metrics with prometheus_client, which is "
            "not installed: pip install 'dcr[metrics]'",
            check="metrics",
        )
    return section


def _runtimes(
    nodes: tuple[RolloutNode, ...], engines: tuple[EngineSection, ...]
) -> tuple[RolloutNode, ...]:
    """Each receiver's ``runtime`` with its default: ``vllm`` for an engine's workers, else
    ``sharded``; an engine's workers must be ``vllm`` and only they may be."""
    hosted = {r for e in engines for r in e.receivers}
    out = []
    for node in nodes:
        receivers = []
        for r in node.receivers:
            where = f"receiver {r.name!r} ([[rollout]] {node.name!r})"
            if not isinstance(r.options, dict):
                raise ConfigError(f"{where}: options must be a table")
            runtime = r.runtime or ("vllm" if r.name in hosted else "sharded")
            if not isinstance(runtime, str) or not runtime:
                raise ConfigError(f"{where}: runtime must name a receiver runtime, got {runtime!r}")
            if r.name in hosted and runtime != "vllm":
                raise ConfigError(
                    f"{where}: runtime = {runtime!r}, but it is a worker of an [[engine]] "
                    "(runtime 'vllm')"
                )
            if runtime == "vllm" and r.name not in hosted:
                raise ConfigError(
                    f"{where}: runtime 'vllm' needs an [[engine]] that lists it among its "
                    "receivers (the launcher starts the engine)"
                )
            receivers.append(replace(r, runtime=runtime))
        out.append(replace(node, receivers=tuple(receivers)))
    return tuple(out)


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
    if cfg.keys is None and not cfg.insecure and not is_loopback(f"tcp://{cfg.host}:0"):
        raise ConfigError(
            f"{cfg.path}: host = {cfg.host!r} is reachable from other hosts, and the fleet has "
            "no keys: anyone who reaches its ports could send and read weights. Make keys "
            '(`dcr keys init keys --fleet FILE`) and say [fleet] keys = "keys", or say '
            "[fleet] insecure = true for a network you trust entirely (docs/security.md)"
        )
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
    if not cfg.trainer.synthetic:
        reference = [r.name for r in cfg.receivers if r.kind == "sharded"]
        if reference:
            raise ConfigError(
                f"receivers {reference} run dcr's sharded serving model of the synthetic trainer's "
                f"[model], but the trainer is {cfg.trainer.kind!r}: give them the runtime "
                "that serves your model (runtime = 'vllm' with an [[engine]], 'torch' with "
                "options.factory, or your own)"
            )
    _check_engines(cfg)
