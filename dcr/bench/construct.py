"""Delta construction benchmark (paper §8.3, Table 3): modes X, P and F on a synthetic model.

A llama-family model of the requested size (bf16) is sliced into a TP=2 training layout.  Each
workload (:mod:`dcr.bench.workloads`) makes the next version -- at an element change rate,
chosen elements updated as ``bf16(w * (1 + 0.01 * eps))``; at an AdamW learning rate, one real
AdamW step on fp32 masters -- and every owner constructs its payloads (change detection,
projection or full conversion, packing, zstd) in parallel threads:

- **X**: direct projection + mixed XOR/overwrite encoding (the default);
- **P**: direct projection + overwrites only;
- **F**: full conversion (assemble every canonical tensor, compare) + overwrites only.

A memory-bandwidth reference is measured right before every timed construction, and each row
reports the median of those paired ratios (``vs_memcpy``): on a shared machine the copy rate
swings by several times between minutes, and a reference taken next to each run sees the
machine that run saw.  The reference is the faster of two single-thread copies (each best of
three): a warm 256 MiB buffer, and the bytes construction reads (every candidate shard and
tracker) copied through that buffer.  On a virtual machine the copy rate also depends on
which physical pages a buffer landed on (3 to 15 GB/s on one 2-core cloud machine); the
second copy reads the very pages construction reads, and taking the faster of the two keeps
a buffer that landed on slow pages from flattering the ratio.  Each row also
carries the order-0 entropy floor of gap-coded positions plus XOR masks of its changed
elements (:func:`dcr.delta.entropy.gap_xor_floor_bytes`, computed after timing) and the
CPU seconds of each construction stage (summed over threads) in the run of median time.

With ``dense_above`` each timed run is followed by the same construction with
:attr:`BuildConfig.dense_above` set (:func:`dcr.bench.builds.adaptive_build`: tensors changed at
least that much are sent dense), and the dense build of the model (every element of the
committed version, what a joining receiver gets) is built and encoded once: sparse, adaptive
and dense payloads side by side.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dcr.bench.builds import adaptive_build, build_streams, encode_payload
from dcr.bench.workloads import (
    Workload,
    changed_fraction,
    changed_text,
    label_of,
    new_version,
    workloads,
)
from dcr.delta.build import BuildConfig, BuildStats
from dcr.delta.entropy import floor_of_items
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.models.families import canonical_shapes, random_state_dict, tiny_config
from dcr.tensors.bits import bits
from dcr.tensors.records import Encoding, Item, Mode, TensorSpec

__all__ = [
    "bandwidth_reference",
    "format_construct_table",
    "run_construct_bench",
    "synthetic_config",
]

MODES = ("X", "P", "F")


def synthetic_config(size_bytes: int) -> dict[str, Any]:
    """A llama-family config whose bf16 checkpoint is at least ``size_bytes``."""
    layers = 1
    while True:
        cfg = tiny_config(
            "llama",
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
        )
        if _checkpoint_bytes(cfg) >= size_bytes:
            return cfg
        layers += 1


def _checkpoint_bytes(cfg: dict[str, Any]) -> int:
    return sum(2 * int(np.prod(s)) for s in canonical_shapes(cfg, "llama").values())


class _Copy:
    """The buffers of the memcpy reference, kept (warm) for the whole benchmark."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in first

    def rate(self, repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            best = min(best, time.perf_counter() - t0)
        return self.src.nbytes / best / 1e9

    def rate_of(self, sources: Sequence[npt.NDArray[np.uint8]], repeats: int) -> float:
        """GB/s of copying every byte of ``sources`` through the buffer (used as a ring)."""
        ring = self.dst
        size = ring.shape[0]
        total = sum(int(s.shape[0]) for s in sources)
        best = float("inf")
        for _ in range(repeats):
            at = 0
            t0 = time.perf_counter()
            for src in sources:
                off, n = 0, int(src.shape[0])
                while off < n:
                    m = min(n - off, size - at)
                    np.copyto(ring[at : at + m], src[off : off + m])
                    off += m
                    at = (at + m) % size
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e9


def _read_bytes(group: LocalTrainingGroup) -> list[npt.NDArray[np.uint8]]:
    """Byte views of what a construction reads: the staged candidate shards and the
    trackers they are compared with."""
    staged = group.staged or {}
    out = [bits(t).reshape(-1).view(np.uint8) for t in staged.values()]
    for owner in group.owners.values():
        out.extend(
            bits(t).reshape(-1).view(np.uint8) for k, t in owner.trackers.items() if k in staged
        )
    return out


def bandwidth_reference(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Single-thread memcpy rate in GB/s (bytes copied per second), best of ``repeats``."""
    return _Copy(nbytes).rate(repeats)


def _construct(
    group: LocalTrainingGroup,
    mode: str,
    pool: ThreadPoolExecutor,
    xor_allowed: frozenset[str],
    keep: list[Item] | None = None,
    *,
    dense: bool = False,
) -> tuple[float, int, int, BuildStats]:
    """One construction of every owner's payloads; returns seconds, bytes, payloads, stats.

    The timed work is every owner's whole construction: detection, projection, packing and
    the encoding of every bucket.  ``keep`` collects the items (references only) for the
    entropy floor; a run that keeps them is not one of the timed runs.  ``dense``: the dense
    build of the committed version instead (``mode`` ignored).
    """
    t0 = time.perf_counter()
    streams = build_streams(
        group,
        mode=Mode.MIXED if mode == "X" else Mode.OVERWRITE,
        xor_allowed=xor_allowed,
        full_conversion=mode == "F",
        dense=dense,
    )

    def run(owner: int, it: Any, stats: BuildStats) -> list[int]:
        sizes = []
        for seq, bucket in enumerate(it):
            t = time.thread_time()
            data = encode_payload(bucket, owner=owner, payload_id=seq, attempt=1)
            sizes.append(len(data))
            stats.add_time("encode", time.thread_time() - t)
            if keep is not None:
                keep.extend(bucket.items)
        return sizes

    futures = [pool.submit(run, owner, it, st) for owner, (it, st) in streams.items()]
    sizes = [s for f in futures for s in f.result()]
    dt = time.perf_counter() - t0
    total = BuildStats()
    for _, st in streams.values():
        total.merge(st)
    return dt, sum(sizes), len(sizes), total


def run_construct_bench(
    *,
    size_bytes: int = 1_100_000_000,
    rates: Sequence[float | Workload] = (0.01, 0.03, 0.05),
    modes: Sequence[str] = MODES,
    repeats: int = 3,
    tp: int = 2,
    seed: int = 0,
    relative_encoding: Encoding = Encoding.ULP,
    chunk_bytes: int = 16 << 20,
    bucket_bytes: int = 64 << 20,
    dense_above: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"results": [...], "model": {...}}`` (see the CLI docs).

    ``rates``: the workloads (:class:`~dcr.bench.workloads.Workload`; a number is an element
    change rate).  Each row carries its ``workload`` label and the measured
    ``changed_fraction`` (elements whose stored bits changed); ``rate`` is the change rate,
    or that measured fraction for an AdamW workload.
    ``dense_above``: each construction is also timed with that
    :attr:`BuildConfig.dense_above` (``adaptive_*`` fields), and the dense build of the model
    is built once (``dense_payload_bytes``, ``dense_construct_seconds``).
    ``relative_encoding`` is what mode X emits (:attr:`BuildConfig.relative_encoding`).
    ``chunk_bytes`` and ``bucket_bytes`` are the pipeline settings (:class:`BuildConfig`):
    the paper's 64 / 512 MiB suit shards of many GB; next to a model of about a GB, buckets
    of 64 MiB let one bucket's encoding overlap the comparison of the next.
    """
    say = log or (lambda _msg: None)
    runs_of = workloads(rates)
    cfg = synthetic_config(size_bytes)
    say(f"building a {cfg['num_hidden_layers']}-layer synthetic llama model")
    base = random_state_dict(cfg, "llama", seed=seed)
    catalog = {n: TensorSpec.of(n, t) for n, t in base.items()}
    plan = build_plan(catalog, TrainLayout(tp=tp), family="llama", config=cfg)
    group = LocalTrainingGroup(
        plan,
        plan.slice(base),
        config=BuildConfig(
            relative_encoding=relative_encoding,
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            dense_above=None,  # the sparse build; the adaptive one sets its own
        ),
        full_conversion="F" in modes,
    )
    checkpoint_bytes = sum(s.nbytes for s in catalog.values())
    base_bits = {n: bits(t).reshape(-1) for n, t in base.items()}
    copy = _Copy(256 << 20)
    say(f"checkpoint {checkpoint_bytes / 1e9:.2f} GB, memcpy reference {copy.rate(5):.1f} GB/s")
    xor_allowed = frozenset(catalog)
    results = []
    dense: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, tp)) as pool:
        if dense_above is not None:
            dense_s, dense_bytes, _, _ = _construct(group, "X", pool, xor_allowed, dense=True)
            dense = {"dense_payload_bytes": dense_bytes, "dense_construct_seconds": dense_s}
            say(f"dense build of the model: {dense_bytes / 1e6:.1f} MB in {dense_s:.3f} s")
        for i, workload in enumerate(runs_of):
            label = workload.label
            new = new_version(base, workload, seed + 1 + i)
            changed_frac = changed_fraction(base, new)
            rate = workload.rate if workload.rate is not None else changed_frac
            group.stage(plan.slice(new))
            sources = _read_bytes(group)
            for mode in modes:
                runs, refs, buffer_refs, source_refs = [], [], [], []
                adaptive = []
                for _ in range(repeats):
                    buffer_refs.append(copy.rate(3))
                    source_refs.append(copy.rate_of(sources, 3))
                    refs.append(max(buffer_refs[-1], source_refs[-1]))
                    runs.append(_construct(group, mode, pool, xor_allowed))
                    if dense_above is not None:
                        with adaptive_build(group, dense_above):
                            adaptive.append(_construct(group, mode, pool, xor_allowed))
                secs = statistics.median(r[0] for r in runs)
                # Bytes and stage seconds of the run of median time (runs that keep their
                # items alive cannot reuse freed memory and run slower).
                _, payload_bytes, num_payloads, st = _median_run(runs)
                # The items for the entropy floor come from one more, untimed construction.
                items: list[Item] = []
                _construct(group, mode, pool, xor_allowed, items)
                paired = [
                    st.source_bytes / run[0] / 1e9 / bw for run, bw in zip(runs, refs, strict=True)
                ]
                changed = st.changed_elements + st.residual_changed
                floor = floor_of_items(items, base_bits)
                del items
                stages = {k: round(v, 6) for k, v in sorted(st.seconds.items())}
                extra: dict[str, Any] = {}
                if adaptive:
                    _, a_bytes, a_payloads, a_st = _median_run(adaptive)
                    extra = {
                        "dense_above": dense_above,
                        "adaptive_payload_bytes": a_bytes,
                        "adaptive_num_payloads": a_payloads,
                        "adaptive_construct_seconds": statistics.median(r[0] for r in adaptive),
                        "adaptive_dense_tensors": a_st.dense_tensors,
                        "adaptive_dense_elements": a_st.dense_elements,
                        **dense,
                    }
                row: dict[str, Any] = {
                    "rate": rate,
                    "workload": label,
                    "changed_fraction": changed_frac,
                    "mode": mode,
                    "changed_elements": changed,
                    "payload_bytes": payload_bytes,
                    "num_payloads": num_payloads,
                    "bytes_per_changed_element": payload_bytes / changed if changed else 0.0,
                    "construct_seconds": secs,
                    "source_bytes": st.source_bytes,
                    "construct_gb_per_s": st.source_bytes / secs / 1e9,
                    "bandwidth_reference_gb_per_s": statistics.median(refs),
                    "buffer_copy_gb_per_s": statistics.median(buffer_refs),
                    "source_copy_gb_per_s": statistics.median(source_refs),
                    "vs_memcpy": statistics.median(paired),
                    "xor_entries": st.xor_entries,
                    "ulp_entries": st.ulp_entries,
                    "overwrite_entries": st.overwrite_entries,
                    "checkpoint_bytes": checkpoint_bytes,
                    "entropy_floor_bytes": floor,
                    "entropy_floor_ratio": payload_bytes / floor if floor else 0.0,
                    "stage_seconds": stages,
                    **({"adamw_lr": workload.value} if workload.kind == "adamw" else {}),
                    **extra,
                }
                results.append(row)
                say(
                    f"{label} ({changed_frac:.2%} changed) mode {mode}: {secs:.3f} s, "
                    f"{row['vs_memcpy']:.2f}x memcpy "
                    f"(reference {min(refs):.1f}-{max(refs):.1f} GB/s), "
                    f"{payload_bytes / 1e6:.1f} MB, "
                    f"{row['bytes_per_changed_element']:.3f} B/changed, floor "
                    f"{floor / changed if changed else 0.0:.3f} B/changed; CPU seconds "
                    + ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
                    + (
                        f"; dense_above {dense_above}: {extra['adaptive_construct_seconds']:.3f} "
                        f"s, {extra['adaptive_payload_bytes'] / 1e6:.1f} MB, "
                        f"{extra['adaptive_dense_tensors']} tensors dense"
                        if extra
                        else ""
                    )
                )
            group.discard()
            del new, sources
    return {
        "results": results,
        "model": {
            "checkpoint_bytes": checkpoint_bytes,
            "layers": cfg["num_hidden_layers"],
            "tp": tp,
            "repeats": repeats,
            "relative_encoding": relative_encoding.name,
            "chunk_bytes": chunk_bytes,
            "bucket_bytes": bucket_bytes,
            "dense_above": dense_above,
            "threads": os.cpu_count(),
            "torch": torch.__version__,
        },
    }


def _median_run(
    runs: Sequence[tuple[float, int, int, BuildStats]],
) -> tuple[float, int, int, BuildStats]:
    """The run of median time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]


def format_construct_table(result: dict[str, Any]) -> str:
    """A fixed-width table of :func:`run_construct_bench` results (with ``dense_above``: the
    adaptive build's and the dense build's bytes and seconds beside the sparse ones)."""
    model = result["model"]
    adaptive = any("adaptive_payload_bytes" in r for r in result["results"])
    head = (
        f"{'workload':>15} {'mode':>4} {'changed':>8} {'elements':>12} {'payload MB':>11} "
        f"{'B/changed':>10} {'seconds':>8} {'GB/s':>6} {'vs memcpy':>9}"
    )
    if adaptive:
        head += f" {'adapt MB':>9} {'adapt s':>8} {'dense t':>7} {'dense MB':>9} {'dense s':>8}"
    lines = [
        f"synthetic llama model: {model['checkpoint_bytes'] / 1e9:.2f} GB bf16, training TP="
        f"{model['tp']}, median of {model['repeats']} runs, {model['threads']} threads; vs memcpy: "
        "median of each run's rate over a memcpy reference measured just before it (the faster "
        "of a 256 MiB buffer copy and a copy of the bytes construction reads)",
        head,
    ]
    for r in result["results"]:
        line = (
            f"{label_of(r):>15} {r['mode']:>4} {changed_text(r):>8} {r['changed_elements']:>12,} "
            f"{r['payload_bytes'] / 1e6:>11.2f} {r['bytes_per_changed_element']:>10.3f} "
            f"{r['construct_seconds']:>8.3f} {r['construct_gb_per_s']:>6.2f} "
            f"{r['vs_memcpy']:>9.2f}"
        )
        if "adaptive_payload_bytes" in r:
            line += (
                f" {r['adaptive_payload_bytes'] / 1e6:>9.2f} "
                f"{r['adaptive_construct_seconds']:>8.3f} {r['adaptive_dense_tensors']:>7} "
                f"{r['dense_payload_bytes'] / 1e6:>9.2f} {r['dense_construct_seconds']:>8.3f}"
            )
        lines.append(line)
    if adaptive:
        lines.append(
            f"adapt: the same construction with dense_above = "
            f"{result['results'][0].get('dense_above')} (dense t: tensors changed at least that "
            "much, sent dense); dense: the dense build of the model (every element), one run"
        )
    return "\n".join(lines)
