"""Delta construction benchmark (paper §8.3, Table 3): modes X, P and F on a synthetic model.

A llama-family model of the requested size (bf16) is sliced into a TP=2 training layout.  For
each element change rate, chosen elements are updated as ``bf16(w * (1 + 0.01 * eps))`` and
every owner constructs its payloads (change detection, projection or full conversion, packing,
zstd) in parallel threads:

- **X**: direct projection + mixed XOR/overwrite encoding (the default);
- **P**: direct projection + overwrites only;
- **F**: full conversion (assemble every canonical tensor, compare) + overwrites only.

A memory-bandwidth reference (a warm ``memcpy`` of 256 MiB, best of several) is measured in the
same run so construction throughput can be read as a ratio on a noisy machine.  Each row also
carries the order-0 entropy floor of gap-coded positions plus XOR masks of its changed
elements (:func:`dcr.delta.entropy.gap_xor_floor_bytes`, computed after timing) and the
CPU seconds of each construction stage (summed over threads).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from dcr.delta.bits import bits
from dcr.delta.entropy import floor_of_items
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.delta.owner import BuildConfig, BuildStats
from dcr.delta.records import Encoding, Item, Mode, TensorSpec
from dcr.testing.models import canonical_shapes, random_state_dict, tiny_config
from dcr.testing.updates import perturb
from dcr.wire.encode import encode_payload
from dcr.wire.format import PayloadHeader, ValueLayout

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


def bandwidth_reference(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Single-thread memcpy rate in GB/s (bytes copied per second), best of ``repeats``."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _construct(
    group: LocalTrainingGroup,
    mode: str,
    pool: ThreadPoolExecutor,
    xor_allowed: frozenset[str],
    keep: list[Item] | None = None,
) -> tuple[float, int, int, BuildStats]:
    """One construction of every owner's payloads; returns seconds, bytes, payloads, stats.

    The timed work is every owner's whole construction: detection, projection, packing and
    the encoding of every bucket.  ``keep`` collects the items (references only) for the
    entropy floor, which is computed after the clock stops.
    """
    t0 = time.perf_counter()
    streams = group.build(
        mode=Mode.MIXED if mode == "X" else Mode.OVERWRITE,
        xor_allowed=xor_allowed,
        full_conversion=mode == "F",
    )

    def run(owner: int, it: Any, stats: BuildStats) -> list[int]:
        sizes = []
        for seq, bucket in enumerate(it):
            t = time.thread_time()
            header = PayloadHeader(attempt=1, owner=owner, payload_id=seq, final=bucket.final)
            sizes.append(len(encode_payload(header, bucket.items, layout=ValueLayout.BYTEPLANE)))
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
    rates: Sequence[float] = (0.01, 0.03, 0.05),
    modes: Sequence[str] = MODES,
    repeats: int = 3,
    tp: int = 2,
    seed: int = 0,
    relative_encoding: Encoding = Encoding.ULP,
    chunk_bytes: int = 16 << 20,
    bucket_bytes: int = 64 << 20,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"results": [...], "model": {...}}`` (see the CLI docs).

    ``relative_encoding`` is what mode X emits (:attr:`BuildConfig.relative_encoding`).
    ``chunk_bytes`` and ``bucket_bytes`` are the pipeline settings (:class:`BuildConfig`):
    the paper's 64 / 512 MiB suit shards of many GB; next to a model of about a GB, buckets
    of 64 MiB let one bucket's encoding overlap the comparison of the next.
    """
    say = log or (lambda _msg: None)
    cfg = synthetic_config(size_bytes)
    say(f"building a {cfg['num_hidden_layers']}-layer synthetic llama model")
    base = random_state_dict(cfg, "llama", seed=seed)
    catalog = {n: TensorSpec.of(n, t) for n, t in base.items()}
    plan = build_plan(catalog, TrainLayout(tp=tp), family="llama", config=cfg)
    group = LocalTrainingGroup(
        plan,
        plan.slice(base),
        config=BuildConfig(
            relative_encoding=relative_encoding, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes
        ),
        full_conversion="F" in modes,
    )
    checkpoint_bytes = sum(s.nbytes for s in catalog.values())
    base_bits = {n: bits(t).reshape(-1) for n, t in base.items()}
    bw = bandwidth_reference()
    say(f"checkpoint {checkpoint_bytes / 1e9:.2f} GB, memcpy reference {bw:.1f} GB/s")
    xor_allowed = frozenset(catalog)
    results = []
    with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, tp)) as pool:
        for i, rate in enumerate(rates):
            new = perturb(base, rate=rate, seed=seed + 1 + i)
            group.stage(plan.slice(new))
            for mode in modes:
                items: list[Item] = []
                runs = [
                    _construct(group, mode, pool, xor_allowed, items if r == repeats - 1 else None)
                    for r in range(repeats)
                ]
                secs = statistics.median(r[0] for r in runs)
                _, payload_bytes, num_payloads, st = runs[-1]
                changed = st.changed_elements + st.residual_changed
                floor = floor_of_items(items, base_bits)
                del items
                stages = {k: round(v, 6) for k, v in sorted(st.seconds.items())}
                row: dict[str, Any] = {
                    "rate": rate,
                    "mode": mode,
                    "changed_elements": changed,
                    "payload_bytes": payload_bytes,
                    "num_payloads": num_payloads,
                    "bytes_per_changed_element": payload_bytes / changed if changed else 0.0,
                    "construct_seconds": secs,
                    "source_bytes": st.source_bytes,
                    "construct_gb_per_s": st.source_bytes / secs / 1e9,
                    "bandwidth_reference_gb_per_s": bw,
                    "xor_entries": st.xor_entries,
                    "ulp_entries": st.ulp_entries,
                    "overwrite_entries": st.overwrite_entries,
                    "checkpoint_bytes": checkpoint_bytes,
                    "entropy_floor_bytes": floor,
                    "entropy_floor_ratio": payload_bytes / floor if floor else 0.0,
                    "stage_seconds": stages,
                }
                results.append(row)
                say(
                    f"rate {rate:.0%} mode {mode}: {secs:.3f} s, {payload_bytes / 1e6:.1f} MB, "
                    f"{row['bytes_per_changed_element']:.3f} B/changed, floor "
                    f"{floor / changed if changed else 0.0:.3f} B/changed; CPU seconds "
                    + ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
                )
            group.discard()
            del new
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
            "threads": os.cpu_count(),
            "torch": torch.__version__,
        },
    }


def format_construct_table(result: dict[str, Any]) -> str:
    """A fixed-width table of :func:`run_construct_bench` results."""
    model = result["model"]
    lines = [
        f"synthetic llama model: {model['checkpoint_bytes'] / 1e9:.2f} GB bf16, training TP="
        f"{model['tp']}, median of {model['repeats']} runs, {model['threads']} threads",
        f"{'rate':>5} {'mode':>4} {'changed':>12} {'payload MB':>11} {'B/changed':>10} "
        f"{'seconds':>8} {'GB/s':>6} {'vs memcpy':>9}",
    ]
    for r in result["results"]:
        lines.append(
            f"{r['rate']:>5.0%} {r['mode']:>4} {r['changed_elements']:>12,} "
            f"{r['payload_bytes'] / 1e6:>11.2f} {r['bytes_per_changed_element']:>10.3f} "
            f"{r['construct_seconds']:>8.2f} {r['construct_gb_per_s']:>6.2f} "
            f"{r['construct_gb_per_s'] / r['bandwidth_reference_gb_per_s']:>9.2f}"
        )
    return "\n".join(lines)
