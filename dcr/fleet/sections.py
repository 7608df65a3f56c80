"""The sections of a fleet file (:mod:`dcr.fleet.config`): the synthetic ``[model]``, the
``[trainer]`` and its construction settings, the ``[[rollout]]`` nodes and their receivers,
the vLLM ``[[engine]]`` tables, the ``[coordinator]`` and ``[metrics]``, each with its
defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dcr.protocol.types import Timeouts
from dcr.tensors.fp8 import Fp8Scheme

if TYPE_CHECKING:
    from dcr.delta.build import BuildConfig

__all__ = [
    "SYNTHETIC",
    "CoordinatorSection",
    "EngineSection",
    "MetricsSection",
    "ModelSection",
    "RaySection",
    "ReceiverSpec",
    "RolloutNode",
    "TrainerSection",
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
    rollout_dtype: str = "bf16"
    """What receivers serve: ``"bf16"``, the trainer's weights as they are, or ``"fp8"``, their
    FP8 quantization (``docs/fp8.md``): the projection weights as float8 values and float32
    scales, everything else as it is; owners send only the tiles that changed."""
    fp8_block: int | str = 128
    """With ``rollout_dtype = "fp8"``: scale tiles of this many rows and columns, or
    ``"channel"`` for one scale per output row."""

    @property
    def fp8(self) -> Fp8Scheme | None:
        """The FP8 rollout scheme, or ``None`` for a BF16 rollout."""
        if self.rollout_dtype != "fp8":
            return None
        return Fp8Scheme(None if self.fp8_block == "channel" else int(self.fp8_block))


SYNTHETIC = "synthetic"
"""The trainer kind that trains a synthetic model (``[model]``): the demo's and the benchmarks'."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSection:
    """The trainer: which one (``kind``), its ranks (one owner each, ``o0 .. o{ranks-1}``) and
    the owners' construction settings.

    ``kind`` is ``synthetic`` (dcr's synthetic trainer of ``[model]``, laid out as ``tp`` x
    ``ep`` x ``dp`` ranks), ``fsdp`` (the FSDP2 GRPO trainer of ``dcr rl``), a name another
    package registered (entry point group ``dcr.trainers``), or ``"package.module:function"``,
    a trainer of your own that ``dcr fleet`` starts once per rank
    (:class:`~dcr.fleet.trainer.TrainerContext`).  ``options`` (``[trainer.options]``) are
    that trainer's settings.
    """

    kind: str = SYNTHETIC
    ranks: int | None = None
    """Trainer processes, one owner each (``o0 .. o{ranks-1}``); the synthetic trainer's is
    ``tp * ep * dp``, every other trainer's defaults to 1."""
    tp: int | None = None
    """Synthetic trainer only: tensor parallelism (default 2)."""
    ep: int | None = None
    """Synthetic trainer only: expert parallelism (default 1)."""
    dp: int | None = None
    """Synthetic trainer only: data parallelism (default 2)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The trainer kind's own settings (``[trainer.options]``)."""
    chunk_mb: float = 8.0
    bucket_mb: float = 16.0
    build_threads: int = 0
    """Worker threads each owner process compares blocks on; 0: the CPUs the process may
    run on (its affinity mask).  With 1, an owner scans in its own thread and does not
    overlap the scan of one bucket with the encoding of the one before."""
    dense_above: float = 0.08
    """Owners send a tensor with at least this fraction of its elements changed as one dense
    overwrite instead of sparse entries (:attr:`dcr.BuildConfig.dense_above`, default 0.08);
    0: always sparse."""
    sends_in_flight: int = 4
    timeout_s: float = 120.0
    """torch.distributed collective timeout of the trainer's process group."""
    lockstep: bool = False
    """Synthetic trainer only: each rank publishes step ``k`` only once every rank computed
    it and the launcher checked version ``k - 1`` on every receiver (``<run_dir>/go.json``),
    so that no optimizer step and no check runs beside a refit (benchmarks time refits this
    way)."""

    def __post_init__(self) -> None:
        threads = self.build_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"build_threads must be an integer >= 0, got {self.build_threads!r}")
        above = self.dense_above
        if isinstance(above, bool) or not isinstance(above, int | float) or not 0 <= above <= 1:
            raise ValueError(f"dense_above must be a number in [0, 1], got {above!r}")
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"kind must name a trainer, got {self.kind!r}")
        if not isinstance(self.options, dict):
            raise ValueError("options must be a table")
        for key in ("ranks", "tp", "ep", "dp"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):  # fmt: skip
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if self.synthetic:
            layout = self.layout
            if self.ranks is not None and self.ranks != layout[0] * layout[1] * layout[2]:
                raise ValueError(
                    f"ranks = {self.ranks}, but the synthetic trainer's tp * ep * dp is "
                    f"{layout[0] * layout[1] * layout[2]}; give one or the other"
                )
            if self.options:
                raise ValueError("the synthetic trainer takes no [trainer.options]")
        else:
            given = [k for k in ("tp", "ep", "dp") if getattr(self, k) is not None]
            if given or self.lockstep:
                raise ValueError(
                    f"{given or ['lockstep']} are the synthetic trainer's; trainer "
                    f"{self.kind!r} takes its layout from [trainer.options] and its process "
                    "count from ranks"
                )

    @property
    def synthetic(self) -> bool:
        return self.kind == SYNTHETIC

    @property
    def layout(self) -> tuple[int, int, int]:
        """The synthetic trainer's (tp, ep, dp)."""
        return (self.tp or 2, self.ep or 1, self.dp or 2)

    @property
    def world_size(self) -> int:
        """Trainer ranks: one owner process each."""
        if self.synthetic:
            tp, ep, dp = self.layout
            return tp * ep * dp
        return self.ranks or 1

    def build_config(self) -> BuildConfig:
        """The owners' construction settings these fields give."""
        from dcr.delta.build import BuildConfig

        return BuildConfig(
            chunk_bytes=int(self.chunk_mb * (1 << 20)),
            bucket_bytes=int(self.bucket_mb * (1 << 20)),
            threads=self.build_threads or None,
            dense_above=self.dense_above or None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverSpec:
    """One serving rank: its name, where it sits in its engine's tensor parallelism, and the
    runtime that holds its weights.

    ``runtime`` is ``vllm`` (a worker of an ``[[engine]]``: the launcher starts the engine),
    ``sharded`` (dcr's sharded serving model of the synthetic ``[model]``, for
    benchmarks), ``torch`` (a torch module of yours, built by ``options.factory =
    "package.module:function"``), a name another package registered (entry point group
    ``dcr.receivers``), or ``"package.module:function"`` directly.  Default: ``vllm`` for an
    engine's workers, else ``sharded``.  ``options`` are the runtime's settings.
    """

    name: str
    tp: int = 1
    rank: int = 0
    runtime: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.runtime == "reference":  # what fleet files of earlier releases call it
            object.__setattr__(self, "runtime", "sharded")

    @property
    def kind(self) -> str:
        """The runtime, defaults resolved by :func:`load_fleet`."""
        return self.runtime or "sharded"


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
    prefix_caching: bool = True
    """``false``: no prefix cache (a batch's numerics never depend on what earlier requests
    cached: reproducible rollouts)."""
    chunked_prefill: bool = True
    """``false``: a prefill is never split across scheduler steps (reproducible rollouts)."""
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
    depart_after_s: float = 30.0
    """A receiver whose control connection has been gone this long departs: it is no longer
    required nor waited for (the transition in flight goes on without it) until it reports
    again.  Well above the control channel's ping and peer timeout; 0 turns it off."""
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

    def __post_init__(self) -> None:
        if self.depart_after_s < 0:
            raise ValueError(f"depart_after_s must be >= 0, got {self.depart_after_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RaySection:
    """Where a fleet's roles run on a Ray cluster (``[ray]``, used by :mod:`dcr.ray`).

    Nodes are told apart by custom resources, as ``ray start --resources`` gives them: the
    fleet's ``[[rollout]]`` nodes go one each to distinct alive Ray nodes carrying
    ``rollout`` (in node-id order), and its trainer ranks to nodes carrying ``trainer``.
    """

    namespace: str = "dcr"
    """The Ray namespace of the fleet's named actors (one fleet per namespace)."""
    trainer: str = "trainer"
    """The custom resource that marks trainer nodes."""
    rollout: str = "rollout"
    """The custom resource that marks rollout nodes (one fleet rollout node each)."""
    coordinators: int = 2
    """Coordinator actors: the active one and its standbys."""
    max_restarts: int = 3
    """Ray restarts of each dcr actor (coordinator, relay node) before the fleet fails."""

    def __post_init__(self) -> None:
        for name in ("namespace", "trainer", "rollout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string")
        if self.coordinators < 1:
            raise ValueError("coordinators must be >= 1")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSection:
    """Per-refit metrics of the fleet's processes in Prometheus form (``[metrics]``,
    :mod:`dcr.metrics`; off by default).

    With ``port`` set, every process serves its own metrics with ``prometheus_client`` on
    ``host``, at ``port`` plus its place in the fleet
    (:func:`dcr.fleet.eventlog.metrics_ports`).  With ``ray``, processes that run in Ray
    actors report through ``ray.util.metrics`` instead, exported by each Ray node's metrics
    agent."""

    port: int = 0
    """The first metrics port of the fleet's processes; 0: no metrics endpoint."""
    host: str = "127.0.0.1"
    """Where the metrics endpoints listen (loopback unless you say otherwise: they are
    unauthenticated)."""
    ray: bool = False
    """Processes in Ray actors report through ``ray.util.metrics``."""

    def __post_init__(self) -> None:
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must name an address, got {self.host!r}")
        if not isinstance(self.ray, bool):
            raise ValueError(f"ray must be true or false, got {self.ray!r}")
