"""One-call in-process refit: owners, payload bytes, decode and apply on every receiver.

:class:`LocalRefit` is the whole data plane in one process, for tests, notebooks, demos and
single-node setups: it builds every owner of the source's training layout, prewarms every
receiver, and on each :meth:`LocalRefit.refit` runs construction -> payload bytes -> strict
decode -> in-place apply through each receiver's native loader, then commits (owners update
their trackers in place).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from dcr.adapters.sources.base import Source
from dcr.apply.loader import Loader
from dcr.apply.receiver import ApplyConfig, Receiver, xor_allowed_across
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.owner import Bucket, BuildConfig, BuildStats
from dcr.delta.records import Mode, TensorSpec
from dcr.errors import ConfigError
from dcr.wire.payload import (
    DecodeLimits,
    PayloadHeader,
    ValueLayout,
    decode_payload,
    encode_payload,
)

__all__ = ["LocalRefit", "RefitConfig", "RefitReport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitConfig:
    """Settings of :class:`LocalRefit`; every field has the documented default."""

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
    """Owners constructing in parallel; 0 means one per CPU core."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RefitReport:
    """What one refit did and measured."""

    version: int
    mode: Mode
    changed_elements: int
    """Source elements whose stored bits changed (each unique element counted once)."""
    residual_changed: int
    """Canonical elements changed in residual tensors (compared after conversion)."""
    payload_bytes: int
    num_payloads: int
    xor_items: int
    overwrite_items: int
    xor_entries: int
    overwrite_entries: int
    checkpoint_bytes: int
    """Size of the canonical checkpoint, for ratios."""
    source_bytes: int
    """Bytes of source shards (and residual tensors) the owners compared."""
    receivers: int
    seconds: Mapping[str, float]
    """Wall seconds per stage: ``source`` (candidate shards from the update), ``construct``
    (detect, project, pack, encode on every owner in parallel), ``decode``, ``apply`` (summed
    over receivers), ``commit`` and ``total``; ``owner_*`` keys sum each owner sub-stage over
    owners (CPU seconds, not wall)."""

    @property
    def bytes_per_changed_element(self) -> float:
        changed = self.changed_elements + self.residual_changed
        return self.payload_bytes / changed if changed else 0.0

    @property
    def checkpoint_fraction(self) -> float:
        return self.payload_bytes / self.checkpoint_bytes if self.checkpoint_bytes else 0.0


def _mode(mode: Mode | str) -> Mode:
    try:
        return mode if isinstance(mode, Mode) else Mode(mode)
    except ValueError:
        raise ConfigError(f"mode must be 'mixed' or 'overwrite', got {mode!r}") from None


class LocalRefit:
    """Refit ``receivers`` from ``source`` in this process.

    ``receivers`` are native loaders (e.g. :class:`~dcr.TorchModuleLoader`) or already built
    :class:`~dcr.apply.receiver.Receiver` objects; each must hold the source's current version.
    ``mode`` is ``"mixed"`` (XOR where every receiver's loader path preserves bits) or
    ``"overwrite"``.
    """

    def __init__(
        self,
        source: Source,
        receivers: Sequence[Loader | Receiver],
        *,
        mode: Mode | str = Mode.MIXED,
        config: RefitConfig | None = None,
    ) -> None:
        self.source = source
        self.config = config or RefitConfig()
        self.mode = _mode(mode)
        self.catalog: Mapping[str, TensorSpec] = source.catalog
        self.group = LocalTrainingGroup(source.plan, source.base_shards(), config=self.config.build)
        self.receivers: list[Receiver] = [
            r if isinstance(r, Receiver) else Receiver(r, self.catalog, self.config.apply)
            for r in receivers
        ]
        for r in self.receivers:
            r.prewarm()
        self.xor_allowed = xor_allowed_across(self.receivers)
        self.version = 0
        self.attempt = 0
        self.checkpoint_bytes = sum(s.nbytes for s in self.catalog.values())
        self._pool = ThreadPoolExecutor(max_workers=self.config.threads or os.cpu_count() or 1)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LocalRefit:
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
        streams = self.group.build(mode=mode, xor_allowed=self.xor_allowed)

        def encode_all(owner: int, buckets: Iterator[Bucket], stats: BuildStats) -> list[bytes]:
            out = []
            for seq, bucket in enumerate(buckets):
                t0 = time.perf_counter()
                header = PayloadHeader(
                    attempt=attempt, owner=owner, payload_id=seq, final=bucket.final
                )
                out.append(
                    encode_payload(
                        header,
                        bucket.items,
                        level=self.config.zstd_level,
                        layout=self.config.value_layout,
                    )
                )
                stats.add_time("encode", time.perf_counter() - t0)
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
        receivers: Sequence[Receiver] | None = None,
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
                    p, catalog=self.catalog, limits=self.config.limits, xor_allowed=r.xor_allowed()
                )
                for p in data
            ]
            decoded.sort(key=lambda p: (p.header.payload_id, p.header.owner))
            t1 = time.perf_counter()
            for p in decoded:
                r.apply_items(p.items, attempt=p.header.attempt)
            t2 = time.perf_counter()
            seconds["decode"] += t1 - t0
            seconds["apply"] += t2 - t1
            if progress is not None:
                progress(done, len(targets))
        return seconds

    def refit(
        self,
        update: Any,
        *,
        mode: Mode | str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> RefitReport:
        """Bring every receiver to the version in ``update`` and commit it.

        ``update`` is what the source turns into candidate shards (a canonical state dict for
        :class:`~dcr.StateDictSource`).  ``progress(stage, done, total)`` is called as stages
        advance.
        """
        mode_ = self.mode if mode is None else _mode(mode)
        t_start = time.perf_counter()
        if progress:
            progress("construct", 0, 1)
        payloads, stats = self.build_payloads(update, mode=mode_)
        t_built = time.perf_counter()
        if progress:
            progress("construct", 1, 1)
        seconds = self.apply_payloads(
            payloads,
            progress=(lambda d, n: progress("apply", d, n)) if progress else None,
        )
        t_applied = time.perf_counter()
        self.group.commit()
        self.version += 1
        t_end = time.perf_counter()
        source = stats.seconds.pop("source", 0.0)
        stage_seconds = {
            "source": source,
            "construct": t_built - t_start - source,
            "decode": seconds["decode"],
            "apply": seconds["apply"],
            "commit": t_end - t_applied,
            "total": t_end - t_start,
        }
        stage_seconds.update({f"owner_{k}": v for k, v in stats.seconds.items()})
        return RefitReport(
            version=self.version,
            mode=mode_,
            changed_elements=stats.changed_elements,
            residual_changed=stats.residual_changed,
            payload_bytes=sum(len(p) for p in payloads),
            num_payloads=len(payloads),
            xor_items=stats.xor_items,
            overwrite_items=stats.overwrite_items,
            xor_entries=stats.xor_entries,
            overwrite_entries=stats.overwrite_entries,
            checkpoint_bytes=self.checkpoint_bytes,
            source_bytes=stats.source_bytes,
            receivers=len(self.receivers),
            seconds=stage_seconds,
        )
