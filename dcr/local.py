"""One-call in-process refit.

:class:`LocalRefit` runs every role of a refit in this process through the real protocol:
one owner engine per training rank, one receiver engine per receiver and a coordinator per
transition, talking over in-memory adapters (control channel, transport) and a commit store
(in-memory by default, or e.g. SQLite).  Each :meth:`LocalRefit.refit` is one transition
``v -> v+1``: construction -> payload bytes -> strict decode -> in-place apply through each
receiver's native loader -> completion ACKs -> compare-and-set commit -> in-place baseline
update, with overwrite retries when something fails (see ``docs/protocol.md``).  Faults can be
injected (:class:`~dcr.adapters.faulty.Faults`) to watch recovery.

:class:`DataPlane` is the data plane alone (no protocol, no retries): build payloads, apply
them, commit -- for experiments and tests that need to hold the pieces in their hands.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.commit.memory import MemoryCommitStore
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.faulty import FaultReport, Faults
from dcr.adapters.registry import load
from dcr.adapters.sources.base import Source
from dcr.adapters.transport.base import Transport
from dcr.apply.applier import Applier, ApplyConfig, xor_allowed_across
from dcr.apply.loader import Loader
from dcr.delta.build import Bucket, BuildConfig, BuildStats
from dcr.delta.group import LocalTrainingGroup
from dcr.engine.cluster import AttemptSummary, LocalCluster, TransitionResult
from dcr.engine.integration import Integration
from dcr.engine.receiver import ReceiverHooks
from dcr.errors import ConfigError, DcrError
from dcr.protocol.proof import ProofConfig, Verdict
from dcr.protocol.receiver import QueueConfig
from dcr.protocol.types import CommitRecord, Timeouts, TransitionOutcome
from dcr.tensors.parallel import default_threads
from dcr.tensors.records import Mode, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_bucket
from dcr.wire.format import DecodeLimits, ValueLayout
from dcr.wire.seal import payload_key

__all__ = ["DataPlane", "LocalRefit", "RefitConfig", "RefitReport", "TransitionFailed"]

LOCAL_TIMEOUTS = Timeouts(
    prepare_s=30.0, arrival_s=300.0, gate_s=60.0, flush_s=600.0, commit_s=2.0, stop_s=120.0
)
"""Deadlines for one process: a commit deadline of 2 s bounds how long an unknown commit
outcome takes to resolve."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitConfig:
    """Settings of :class:`LocalRefit` and :class:`DataPlane`; every field has a default."""

    build: BuildConfig = field(default_factory=BuildConfig)
    """Chunk and bucket targets of the owners."""
    zstd_level: int = 1
    """zstd level of payload bodies."""
    value_layout: ValueLayout = ValueLayout.BYTEPLANE
    """How values and gap locations are laid out before zstd."""
    apply: ApplyConfig = field(default_factory=ApplyConfig)
    """Receiver settings (post-apply checks, placeholder scheme)."""
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    """Bounds the strict decoder enforces on received payloads."""
    threads: int = 0
    """Worker threads for construction, decode and apply; 0 means one per CPU core."""
    timeouts: Timeouts = LOCAL_TIMEOUTS
    """Protocol deadlines (``LocalRefit`` only)."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """Receivers' bounded queue of decoded payloads (default 32 groups x 8 + 8)."""
    sync: bool = True
    """Synchronous RL (apply while payloads stream) or asynchronous RL (stage compressed
    payloads while serving, apply after the gate closes)."""
    proof: ProofConfig | None = field(default_factory=ProofConfig)
    """Proof of the base version (``LocalRefit`` only): a seeded sample of stored bits at
    every prepare, the complete fingerprint when receivers start, restart or rejoin.  A
    receiver that fails it is restored by dense refit; ``None`` trusts every receiver."""
    join_wait_s: float = 30.0
    """How long the retry after a failed proof waits for the receivers it disproved to be
    restored by dense refit and report ready (``LocalRefit`` only): they then take part in
    the commit.  0 retries at once without them (they join the next refit)."""
    fleet_secret: bytes | None = field(default=None, repr=False)
    """A 32-byte fleet secret: owners seal every payload with its payload key and receivers
    refuse any payload not sealed with it (:mod:`dcr.wire.seal`).  ``None``: unkeyed BLAKE3
    digests."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitReport:
    """What one refit did and measured."""

    version: int
    mode: Mode
    changed_elements: int
    """Canonical elements whose stored bits changed, each counted once (a replicated training
    copy counts nothing; a tied element counts once in each canonical tensor it lands in)."""
    residual_changed: int
    """Canonical elements changed in residual tensors (compared after conversion)."""
    payload_bytes: int
    """Compressed payload bytes sent, over all attempts."""
    num_payloads: int
    xor_items: int
    overwrite_items: int
    xor_entries: int
    overwrite_entries: int
    checkpoint_bytes: int
    """Size of the canonical checkpoint, for ratios."""
    ulp_items: int = 0
    """Items of ULP deltas (mixed mode's relative encoding for float dtypes, the default)."""
    ulp_entries: int = 0
    source_bytes: int
    """Bytes of source shards (and residual tensors) the owners compared."""
    receivers: int
    seconds: Mapping[str, float]
    """Wall seconds: ``source`` (candidate shards from the update), ``transition`` (the
    protocol run, construction to baseline update, stages overlapping), ``total``; and
    worker seconds summed over owners or receivers: ``construct`` (detect, project, pack,
    encode), ``decode``, ``apply`` (plus ``owner_*`` sub-stages)."""
    attempts: tuple[AttemptSummary, ...] = ()
    """The attempts of the transition: the first in mixed mode, retries in overwrite mode."""
    faults: FaultReport = field(default_factory=FaultReport)
    """What injected faults did (dropped payloads, killed endpoints, ...)."""
    committed_by: int | None = None
    """Epoch of the coordinator whose compare-and-set committed this version (a replaced
    coordinator that kept running may have committed it first)."""
    proofs: tuple[Verdict, ...] = ()
    """Proofs of the base version judged during the transition: receivers that failed
    (they were restored by dense refit and did not take part), positions compared."""

    @property
    def bytes_per_changed_element(self) -> float:
        changed = self.changed_elements + self.residual_changed
        return self.payload_bytes / changed if changed else 0.0

    @property
    def checkpoint_fraction(self) -> float:
        return self.payload_bytes / self.checkpoint_bytes if self.checkpoint_bytes else 0.0


class TransitionFailed(DcrError):
    """A refit ended without committing (conflict, rejection or operator abort)."""

    def __init__(self, outcome: TransitionOutcome, reason: str) -> None:
        self.outcome = outcome
        super().__init__(f"the transition ended {outcome.value}: {reason}", check=outcome.value)


async def _construct(cls: type, **kwargs: Any) -> Any:
    """Build an adapter inside the engine's event loop (sockets bind to that loop)."""
    return cls(**kwargs)


def _mode(mode: Mode | str) -> Mode:
    try:
        return mode if isinstance(mode, Mode) else Mode(mode)
    except ValueError:
        raise ConfigError(f"mode must be 'mixed' or 'overwrite', got {mode!r}") from None


class _Base:
    """Owners of the source's layout and prewarmed receivers, shared by both front ends."""

    def __init__(
        self,
        source: Source,
        receivers: Sequence[Loader | Applier],
        *,
        mode: Mode | str,
        config: RefitConfig | None,
    ) -> None:
        self.source = source
        self.config = config or RefitConfig()
        self.mode = _mode(mode)
        self.catalog: Mapping[str, TensorSpec] = source.catalog
        self.group = LocalTrainingGroup(source.plan, source.base_shards(), config=self.config.build)
        self.receivers: list[Applier] = [
            r if isinstance(r, Applier) else Applier(r, self.catalog, self.config.apply)
            for r in receivers
        ]
        for r in self.receivers:
            r.prewarm()
        self.xor_allowed = xor_allowed_across(self.receivers)
        self.version = 0
        self.checkpoint_bytes = sum(s.nbytes for s in self.catalog.values())
        self.threads = self.config.threads or default_threads()
        self._seal_key = payload_key(self.config.fleet_secret)

    def _report(self, stats: BuildStats, seconds: dict[str, float], **fields: Any) -> RefitReport:
        seconds["construct"] = sum(
            stats.seconds.get(k, 0.0) for k in ("detect", "project", "pack", "encode", "convert")
        )
        seconds.update({f"owner_{k}": v for k, v in stats.seconds.items()})
        return RefitReport(
            version=self.version,
            changed_elements=stats.changed_elements,
            residual_changed=stats.residual_changed,
            xor_items=stats.xor_items,
            overwrite_items=stats.overwrite_items,
            xor_entries=stats.xor_entries,
            ulp_items=stats.ulp_items,
            ulp_entries=stats.ulp_entries,
            overwrite_entries=stats.overwrite_entries,
            checkpoint_bytes=self.checkpoint_bytes,
            source_bytes=stats.source_bytes,
            receivers=len(self.receivers),
            seconds=seconds,
            **fields,
        )


class LocalRefit(_Base):
    """Refit ``receivers`` from ``source`` in this process, through the refit protocol.

    ``receivers`` are native loaders (e.g. :class:`~dcr.TorchModuleLoader`) or prebuilt
    :class:`~dcr.apply.applier.Applier` objects; each should hold the source's current
    version: with ``config.proof`` (the default) every prepare proves it (a seeded sample of
    stored bits; the complete fingerprint at the first refit and whenever a receiver is
    restored), and a receiver that fails the proof is restored by dense refit instead of
    taking part (``RefitReport.proofs``).  ``mode="mixed"`` XOR-encodes where every
    receiver's loader path preserves bits; ``"overwrite"`` sends absolute values only.
    ``store`` is the commit store (default in-memory; pass e.g.
    :class:`~dcr.adapters.commit.SqliteCommitStore` for a durable one);
    ``hooks`` maps receiver names (``r0``, ``r1``, ...) to request-gate and KV-cache actions.
    ``transport`` and ``control`` are adapter objects or registered names (``"memory"``, the
    default; ``control="zmq"`` runs every call and reply through real ZeroMQ sockets and the
    control codec on 127.0.0.1).  Owners are named ``o<rank>``.  Close it (or use it as a
    context manager) to stop the engines.
    """

    def __init__(
        self,
        source: Source,
        receivers: Sequence[Loader | Applier],
        *,
        mode: Mode | str = Mode.MIXED,
        config: RefitConfig | None = None,
        store: CommitStore | None = None,
        hooks: Mapping[str, ReceiverHooks] | None = None,
        transport: Transport | str = "memory",
        control: ControlChannel | str = "memory",
    ) -> None:
        super().__init__(source, receivers, mode=mode, config=config)
        self.store = store or MemoryCommitStore()
        ranks = range(source.plan.layout.world_size)
        self.integration = Integration(
            catalog=self.catalog,
            xor_names=self.xor_allowed if self.mode is Mode.MIXED else frozenset(),
            owner_ids={f"o{r}": r for r in ranks},
            zstd_level=self.config.zstd_level,
            value_layout=self.config.value_layout,
            limits=self.config.limits,
        )
        self.receiver_names = tuple(f"r{i}" for i in range(len(self.receivers)))
        self._hooks = dict(hooks or {})
        self._built: list[Any] = []
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._closed = False
        try:
            self._committed = self._portal.call(self._read_record)
            self.cluster = LocalCluster(
                group=self.group,
                receivers=dict(zip(self.receiver_names, self.receivers, strict=True)),
                integration=self.integration,
                store=self.store,
                control=self._adapter("control", control),
                transport=self._adapter("transport", transport),
                sync=self.config.sync,
                timeouts=self.config.timeouts,
                queue=self.config.queue,
                hooks=self._hooks,
                limiter=anyio.CapacityLimiter(self.threads),
                proof=self.config.proof,
                join_wait_s=self.config.join_wait_s,
                fleet_secret=self.config.fleet_secret,
            )
            self.cluster.versions[self._committed] = source.base_shards()
            self._running = self._portal.wrap_async_context_manager(self._serve())
            self._running.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def _adapter(self, kind: str, given: object) -> Any:
        """An adapter given as an object, or by its registered name (``dcr.adapters.registry``);
        by name, in-process adapters take no options (``zmq`` control finds the coordinator
        through this refit's commit store)."""
        if not isinstance(given, str):
            return given
        cls = load(kind, given)
        if kind == "control" and given == "zmq":
            adapter = self._portal.call(lambda: _construct(cls, store=self.store))
        else:
            adapter = self._portal.call(lambda: _construct(cls))
        self._built.append(adapter)
        return adapter

    async def _read_record(self) -> Any:
        return (await self.store.read()).record

    @property
    def record(self) -> CommitRecord:
        """The commit record ``(version, candidate id)`` the commit store holds now."""
        record: CommitRecord = self._portal.call(self._read_record)
        return record

    @asynccontextmanager
    async def _serve(self) -> AsyncIterator[None]:
        try:
            async with anyio.create_task_group() as tg:
                await self.cluster.start(tg, self._committed)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            # Adapters built here by name are this refit's to close.
            with anyio.CancelScope(shield=True):
                for adapter in self._built:
                    await adapter.aclose()

    def close(self) -> None:
        """Stop every engine and the event loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._running.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> LocalRefit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refit(
        self,
        update: Any,
        *,
        mode: Mode | str | None = None,
        faults: Faults | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RefitReport:
        """Run the transition to the version in ``update`` and commit it.

        ``update`` is what the source turns into candidate shards (a canonical state dict for
        :class:`~dcr.StateDictSource`).  ``mode="overwrite"`` sends absolute values only for
        this refit.  ``faults`` injects failures into the first attempt.
        ``progress(stage, done, total)`` is called as stages advance.  Raises
        :class:`TransitionFailed` when the transition ends without a commit.
        """
        if self._closed:
            raise ConfigError("this LocalRefit is closed")
        first = Mode.OVERWRITE if self.mode is Mode.OVERWRITE else _mode(mode or self.mode)
        t0 = time.perf_counter()
        if progress:
            progress("source", 0, 1)
        candidate = self.source.candidate_shards(update)
        self.group.stage(candidate)
        t1 = time.perf_counter()
        before = [
            (s.decode_seconds, s.apply_seconds) for s in self.cluster.receiver_services.values()
        ]
        if progress:
            progress("transition", 0, 1)
        self.cluster.progress = progress
        try:
            result: TransitionResult = self._portal.call(self.cluster.transition, faults, first)
        finally:
            self.cluster.progress = None
        t2 = time.perf_counter()
        if result.outcome is not TransitionOutcome.COMMITTED:
            self.group.discard()
            raise TransitionFailed(result.outcome, result.reason)
        del self.cluster.versions[self._committed]
        self._committed = result.record
        self.cluster.versions[self._committed] = candidate
        self.version += 1
        if progress:
            progress("transition", 1, 1)
        after = [
            (s.decode_seconds, s.apply_seconds) for s in self.cluster.receiver_services.values()
        ]
        seconds = {
            "source": t1 - t0,
            "transition": t2 - t1,
            "total": time.perf_counter() - t0,
            "decode": sum(a[0] for a in after) - sum(b[0] for b in before),
            "apply": sum(a[1] for a in after) - sum(b[1] for b in before),
        }
        modes = {a.mode for a in result.attempts}
        overwrite_only = Mode.OVERWRITE in modes or not self.cluster.side.xor_allowed
        return self._report(
            result.stats,
            seconds,
            mode=Mode.OVERWRITE if overwrite_only else self.mode,
            payload_bytes=result.payload_bytes,
            num_payloads=result.num_payloads,
            attempts=result.attempts,
            faults=result.faults.report(),
            committed_by=result.committed_by,
            proofs=result.verdicts,
        )


class DataPlane(_Base):
    """The data plane alone, in this process: build payloads, apply them, commit.

    No protocol runs: nothing deduplicates, retries or commits for you.  Use it to inspect
    payloads, reproduce a partial apply followed by an overwrite retry, or measure stages.
    """

    def __init__(
        self,
        source: Source,
        receivers: Sequence[Loader | Applier],
        *,
        mode: Mode | str = Mode.MIXED,
        config: RefitConfig | None = None,
    ) -> None:
        super().__init__(source, receivers, mode=mode, config=config)
        self.attempt = 0
        self._pool = ThreadPoolExecutor(max_workers=self.threads)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build_payloads(
        self, update: Any, *, mode: Mode | str | None = None
    ) -> tuple[list[bytes], BuildStats]:
        """Stage ``update`` and construct every owner's payloads (no receiver is touched)."""
        mode = self.mode if mode is None else _mode(mode)
        t0 = time.perf_counter()
        self.group.stage(self.source.candidate_shards(update))
        source_seconds = time.perf_counter() - t0
        self.attempt += 1
        attempt = self.attempt
        xor = self.xor_allowed if self.mode is Mode.MIXED else frozenset()
        streams = self.group.build(mode=mode, xor_allowed=xor)

        def encode_all(owner: int, buckets: Iterator[Bucket], stats: BuildStats) -> list[bytes]:
            out = []
            for seq, bucket in enumerate(buckets):
                t = time.perf_counter()
                out.append(
                    encode_bucket(
                        items=bucket.items,
                        attempt=attempt,
                        owner=owner,
                        payload_id=seq,
                        final=bucket.final,
                        level=self.config.zstd_level,
                        layout=self.config.value_layout,
                        seal_key=self._seal_key,
                    )
                )
                stats.add_time("encode", time.perf_counter() - t)
            return out

        futures = [
            self._pool.submit(encode_all, owner, it, stats)
            for owner, (it, stats) in streams.items()
        ]
        payloads = [p for f in futures for p in f.result()]
        total = BuildStats()
        for _, stats in streams.values():
            total.merge(stats)
        total.add_time("source", source_seconds)
        return payloads, total

    def apply_payloads(
        self,
        payloads: Iterable[bytes],
        receivers: Sequence[Applier] | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """Decode (strictly) and apply payloads in declared order on every receiver."""
        data = list(payloads)
        targets = self.receivers if receivers is None else list(receivers)
        seconds = {"decode": 0.0, "apply": 0.0}
        for done, r in enumerate(targets, start=1):
            t0 = time.perf_counter()
            decoded = [
                decode_payload(
                    p,
                    catalog=self.catalog,
                    limits=self.config.limits,
                    xor_allowed=r.xor_allowed(),
                    seal_key=self._seal_key,
                )
                for p in data
            ]
            decoded.sort(key=lambda p: p.header.order)
            t1 = time.perf_counter()
            for attempt in sorted({p.header.attempt for p in decoded}):
                r.apply_payloads(
                    (p.items for p in decoded if p.header.attempt == attempt), attempt=attempt
                )
            seconds["decode"] += t1 - t0
            seconds["apply"] += time.perf_counter() - t1
            if progress is not None:
                progress(done, len(targets))
        return seconds

    def commit(self) -> None:
        """Owners update their trackers and residual baseline to the staged candidate."""
        self.group.commit()
        self.version += 1

    def refit(self, update: Any, *, mode: Mode | str | None = None) -> RefitReport:
        """Build, apply on every receiver, commit -- without the protocol."""
        mode_ = self.mode if mode is None else _mode(mode)
        t0 = time.perf_counter()
        payloads, stats = self.build_payloads(update, mode=mode_)
        seconds = self.apply_payloads(payloads)
        self.commit()
        source = stats.seconds.pop("source", 0.0)
        seconds.update({"source": source, "transition": time.perf_counter() - t0 - source})
        seconds["total"] = time.perf_counter() - t0
        return self._report(
            stats,
            seconds,
            mode=mode_ if self.mode is Mode.MIXED else Mode.OVERWRITE,
            payload_bytes=sum(len(p) for p in payloads),
            num_payloads=len(payloads),
        )
