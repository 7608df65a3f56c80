"""Dense refit benchmark: the memory and time of restoring a receiver from the owners.

A receiver that starts, restarts or was disproved is restored by a *dense refit*: every owner
sends every committed element as overwrite records (:meth:`~dcr.delta.owner.Owner.build_dense`)
and the receiver decodes and applies them.  On the ``dcr bench construct`` model (a synthetic
llama-family bf16 checkpoint in a TP=``tp`` training layout) this measures, each phase in a
fresh process so that its peak resident memory is its own:

- **build**: every owner's dense buckets, each encoded as the fleet's owners encode them (one
  payload at a time); the peak resident memory above what the process held before the build
  (model, trackers), and the peak of numpy's traced allocations (``tracemalloc``);
- **apply**, per receiver kind: the payloads (built beforehand, held as bytes) are strictly
  decoded and applied one at a time onto a receiver that holds other weights; the peak resident
  memory above what it held before (module, payload bytes), the seconds of decoding and of
  applying, and the seconds of a dense native load of the same version through the same loader
  (median of three).  The applied bits are compared with that dense load; a mismatch fails
  the run.

Resident memory is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` when the phase starts), with glibc's mmap threshold fixed at 1 MiB
(as the fleet's processes run) so that freed buffers are returned rather than cached.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dcr.bench.apply import NotBitExact, _receivers, _stored_bits
from dcr.bench.construct import synthetic_config
from dcr.delta.build import BuildConfig
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.models.families import random_state_dict
from dcr.tensors.bits import bits_dtype, differing
from dcr.tensors.records import TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_bucket

__all__ = ["LOADERS", "format_dense_table", "run_dense_bench"]

LOADERS = ("torch", "sharded-tp2", "vllm")
FAMILY = "llama"
MiB = 1 << 20


def _status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in KiB (``None`` where there is no procfs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> int | None:
    """Reset the resident high-water mark to the current resident size; returns it (bytes)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    return None if rss is None else rss * 1024


def _peak() -> int | None:
    hwm = _status_kib("VmHWM")
    return None if hwm is None else hwm * 1024


def _above(peak: int | None, base: int | None) -> int | None:
    return None if peak is None or base is None else peak - base


def _group(
    size_bytes: int, tp: int, chunk_bytes: int, bucket_bytes: int, seed: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor], LocalTrainingGroup]:
    cfg = synthetic_config(size_bytes)
    base = random_state_dict(cfg, FAMILY, seed=seed)
    catalog = {n: TensorSpec.of(n, t) for n, t in base.items()}
    plan = build_plan(catalog, TrainLayout(tp=tp), family=FAMILY, config=cfg)
    config = BuildConfig(chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes)
    return cfg, base, LocalTrainingGroup(plan, plan.slice(base), config=config)


def _dense_payloads(group: LocalTrainingGroup, keep: bool) -> tuple[list[bytes], dict[str, Any]]:
    """Every owner's dense payloads, built and encoded one at a time (kept when ``keep``)."""
    out: list[bytes] = []
    total = count = largest = 0
    for owner, (buckets, _) in group.build_dense().items():
        # One bucket at a time, as the fleet's owners pull them (``enumerate`` would hold
        # the previous bucket while the next one is built).
        seq = 0
        while (bucket := next(buckets, None)) is not None:
            data = encode_bucket(
                items=bucket.items, attempt=1, owner=owner, payload_id=seq, final=bucket.final
            )
            largest = max(largest, bucket.input_bytes)
            del bucket
            total += len(data)
            count += 1
            seq += 1
            if keep:
                out.append(data)
            del data
    return out, {"payload_bytes": total, "payloads": count, "largest_bucket_bytes": largest}


def _build_phase(
    size_bytes: int, tp: int, chunk_bytes: int, bucket_bytes: int, seed: int
) -> dict[str, Any]:
    _, base, group = _group(size_bytes, tp, chunk_bytes, bucket_bytes, seed)
    checkpoint = sum(t.nbytes for t in base.values())
    del base
    before = _reset_peak()
    tracemalloc.start()
    t0 = time.perf_counter()
    _, sizes = _dense_payloads(group, keep=False)
    seconds = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "phase": "build",
        "checkpoint_bytes": checkpoint,
        "seconds": seconds,
        "peak_rss_above_bytes": _above(_peak(), before),
        "traced_peak_bytes": traced,
        **sizes,
    }


def _apply_phase(
    size_bytes: int,
    tp: int,
    chunk_bytes: int,
    bucket_bytes: int,
    seed: int,
    kind: str,
    threads: int | None,
) -> dict[str, Any]:
    cfg, base, group = _group(size_bytes, tp, chunk_bytes, bucket_bytes, seed)
    payloads, sizes = _dense_payloads(group, keep=True)
    del group
    garbage = random_state_dict(cfg, FAMILY, seed=seed + 1)
    with _receivers(kind, cfg, garbage, threads) as receivers:
        del garbage
        before = _reset_peak()
        decode_s = apply_s = 0.0
        for data in payloads:
            for r in receivers:
                t0 = time.perf_counter()
                payload = decode_payload(data, catalog=r.catalog, xor_allowed=r.xor_allowed())
                t1 = time.perf_counter()
                r.apply_items(payload.items, attempt=1)
                apply_s += time.perf_counter() - t1
                decode_s += t1 - t0
                del payload
        peak = _above(_peak(), before)
        applied = _stored_bits(receivers)
        dense = []
        for _ in range(3):
            t0 = time.perf_counter()
            for r in receivers:
                r.dense_load(base)
            dense.append(time.perf_counter() - t0)
        for rank, (r, snap) in enumerate(zip(receivers, applied, strict=True)):
            for name, t in r.loader.storage_tensors():
                now = t.detach().reshape(-1).view(bits_dtype(t.dtype))
                diff = differing(snap[name], now)
                if diff:
                    raise NotBitExact(
                        f"{kind}: rank {rank} {name!r} differs from a dense load at {diff} "
                        "elements after a dense refit"
                    )
        ranks = len(receivers)
    dense_s = statistics.median(dense)
    return {
        "phase": "apply",
        "loader": kind,
        "ranks": ranks,
        "decode_seconds": decode_s,
        "apply_seconds": apply_s,
        "dense_load_seconds": dense_s,
        "ratio": apply_s / dense_s,
        "peak_rss_above_bytes": peak,
        "bit_exact": True,
        **sizes,
    }


def _in_child(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a fresh spawned process with glibc's mmap threshold at 1 MiB."""
    key = "MALLOC_MMAP_THRESHOLD_"
    old = os.environ.get(key)
    os.environ[key] = str(MiB)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            result: dict[str, Any] = pool.apply(fn, args)
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old
    return result


def run_dense_bench(
    *,
    size_bytes: int = 1_100_000_000,
    tp: int = 2,
    chunk_bytes: int = 16 * MiB,
    bucket_bytes: int = 64 * MiB,
    loaders: Sequence[str] = ("torch", "sharded-tp2"),
    threads: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"build": {...}, "apply": [...], "model": {...}}``."""
    say = log or (lambda _msg: None)
    cfg = synthetic_config(size_bytes)
    args = (size_bytes, tp, chunk_bytes, bucket_bytes, seed)
    say(f"dense build of a {cfg['num_hidden_layers']}-layer synthetic llama model, TP={tp}")
    build = _in_child(_build_phase, *args)
    say(
        f"build: {build['seconds']:.2f} s, peak {_mib(build['peak_rss_above_bytes'])} above "
        f"the trackers (traced {_mib(build['traced_peak_bytes'])})"
    )
    notes: list[str] = []
    applies = []
    for kind in loaders:
        if kind == "vllm":
            from dcr.bench.apply import vllm_available

            if not vllm_available():
                notes.append("vllm: skipped, vllm is not installed in this environment")
                say(notes[-1])
                continue
        row = _in_child(_apply_phase, *args, kind, threads)
        applies.append(row)
        say(
            f"apply {kind}: decode {row['decode_seconds']:.2f} s, apply "
            f"{row['apply_seconds']:.2f} s, dense load {row['dense_load_seconds']:.2f} s, peak "
            f"{_mib(row['peak_rss_above_bytes'])} above the module and payloads, bit-exact"
        )
    return {
        "build": build,
        "apply": applies,
        "model": {
            "checkpoint_bytes": build["checkpoint_bytes"],
            "layers": cfg["num_hidden_layers"],
            "training_tp": tp,
            "chunk_bytes": chunk_bytes,
            "bucket_bytes": bucket_bytes,
            "threads": threads or min(os.cpu_count() or 1, 8),
            "torch": torch.__version__,
        },
        "notes": notes,
    }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MiB:,.0f} MiB"


def format_dense_table(result: dict[str, Any]) -> str:
    """A fixed-width table of :func:`run_dense_bench` results."""
    model, build = result["model"], result["build"]
    lines = [
        f"synthetic llama model: {model['checkpoint_bytes'] / 1e9:.2f} GB bf16, training TP "
        f"{model['training_tp']}, buckets of {model['bucket_bytes'] / MiB:.0f} MiB",
        f"build: {build['seconds']:.2f} s, {build['payloads']} payloads, "
        f"{build['payload_bytes'] / 1e9:.2f} GB; peak RSS above the trackers "
        f"{_mib(build['peak_rss_above_bytes'])}, traced {_mib(build['traced_peak_bytes'])}",
        f"{'loader':>14} {'decode s':>9} {'apply s':>9} {'dense s':>9} {'ratio':>6} "
        f"{'peak RSS':>12}",
    ]
    for r in result["apply"]:
        lines.append(
            f"{r['loader']:>14} {r['decode_seconds']:>9.2f} {r['apply_seconds']:>9.2f} "
            f"{r['dense_load_seconds']:>9.2f} {r['ratio']:>6.2f} "
            f"{_mib(r['peak_rss_above_bytes']):>12}"
        )
    lines.extend(result.get("notes", []))
    return "\n".join(lines)
