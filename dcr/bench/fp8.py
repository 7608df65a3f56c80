"""FP8 rollout benchmark: what a BF16 trainer's refit costs when the engines serve FP8.

A llama-family model of the requested size (bf16) is quantized to its FP8 rollout checkpoint
(:mod:`dcr.models.fp8`) with each scheme of ``--blocks`` (128 x 128 tiles, per-output-channel
scales, ...).  Each workload (:mod:`dcr.bench.workloads`) makes the next BF16 version, and two
constructions of the rollout refit are timed (median of ``repeats``):

- **delta**: scan the BF16 weights for changed elements, mark the tiles they touch, re-quantize
  only those against the committed FP8 values and scales (:func:`dcr.tensors.fp8.requantize`),
  and encode the FP8 values and scales that changed as overwrites, with the changed elements of
  the BF16 tensors (norms, embeddings, LM head) as overwrites too;
- **dense**: quantize every weight and encode the whole rollout checkpoint (a dense FP8 refit,
  the transfer the delta replaces).

Each row reports the tiles touched (the fraction of all tiles of the quantized weights), the
FP8 values and scales that changed, payload bytes of both (zstd, byte-planed values, one
payload per tensor), construction seconds, the same for the owners' adaptive choice
(``dense_above``, :data:`~dcr.delta.build.DENSE_ABOVE` by default: a region whose FP8 values
changed that much goes whole, one span item), and whether the delta applied to the committed
FP8 checkpoint gives exactly the bits of the new version's full quantization.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from dcr.bench.construct import synthetic_config
from dcr.bench.workloads import Workload, changed_fraction, label_of, new_version, workloads
from dcr.delta.build import DENSE_ABOVE
from dcr.delta.fp8 import Fp8Rollout, Fp8Stats, overwrite_item
from dcr.models.families import random_state_dict
from dcr.models.fp8 import quantized_names
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import Fp8Scheme
from dcr.tensors.records import Item
from dcr.wire.encode import encode_bucket
from dcr.wire.format import ValueLayout

__all__ = ["format_fp8_table", "run_fp8_bench"]


def _encode(items: Sequence[Item], payload_id: int) -> int:
    if not items:
        return 0
    data = encode_bucket(items=items, attempt=1, owner=0, payload_id=payload_id, final=False,
                         layout=ValueLayout.BYTEPLANE)  # fmt: skip
    return len(data)


def _dense(
    new: Mapping[str, torch.Tensor], names: set[str], scheme: Fp8Scheme
) -> tuple[dict[str, int], Fp8Rollout]:
    """Quantize everything, encode everything: bytes per canonical tensor."""
    fresh = Fp8Rollout(scheme, {n: new[n] for n in new if n in names})
    sizes = {}
    for i, (name, t) in enumerate(new.items()):
        whole = [overwrite_item(name, t, None, bits(t).reshape(-1))]
        sizes[name] = _encode(fresh.dense_items([name]) if name in names else whole, i)
    return sizes, fresh


def _delta(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    rollout: Fp8Rollout,
    dense_above: float | None = None,
) -> tuple[dict[str, int], Fp8Stats]:
    """Scan, re-quantize the touched tiles, encode the changes: bytes per canonical tensor and
    what changed.  ``dense_above``: a tensor (BF16) or region (FP8) changed at least that much
    goes whole, as owners choose.  The candidate stays staged in ``rollout`` (discarded first,
    so repeats start from the committed version)."""
    rollout.discard()
    stats = Fp8Stats()
    sizes: dict[str, int] = {}
    for i, (name, t) in enumerate(new.items()):
        new_bits = bits(t).reshape(-1)
        changed = np.flatnonzero(bits(base[name]).reshape(-1) != new_bits)
        if name in rollout.mirror and changed.shape[0] * 4 >= t.numel():
            items = rollout.stage_region(name, t, stats, dense_above=dense_above)  # as owners do
        elif name in rollout.mirror:
            items = rollout.stage(name, changed, new_bits[changed], stats, dense_above=dense_above)
        elif dense_above is not None and changed.shape[0] >= dense_above * t.numel():
            items = [overwrite_item(name, t, None, new_bits)]
        elif changed.shape[0]:
            items = [overwrite_item(name, t, changed, new_bits[changed])]
        else:
            items = []
        sizes[name] = _encode(items, i)
    return sizes, stats


def _exact(rollout: Fp8Rollout, fresh: Fp8Rollout) -> bool:
    """The committed FP8 checkpoint moved by the delta is bit for bit the fresh one."""
    rollout.commit()
    return all(
        np.array_equal(bits(rollout.q[n]), bits(fresh.q[n]))
        and np.array_equal(bits(rollout.s[n]), bits(fresh.s[n]))
        for n in fresh.q
    )


def _median_seconds(run: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run_fp8_bench(
    *,
    size_bytes: int = 1024 << 20,
    rates: Sequence[float | Workload] = (0.01, 0.03, 0.05),
    blocks: Sequence[int | None] = (128, None),
    repeats: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Rows of tiles touched, bytes and construction seconds per workload and scheme."""
    say = progress or (lambda _msg: None)
    cfg = synthetic_config(size_bytes)
    base = random_state_dict(cfg, "llama", seed=seed)
    shapes = {n: tuple(t.shape) for n, t in base.items()}
    names = set(quantized_names(shapes))
    total_bytes = sum(t.numel() * t.element_size() for t in base.values())
    rows = []
    for k, workload in enumerate(workloads(rates), start=1):
        new = new_version(base, workload, seed=seed + k)
        fraction = changed_fraction(base, new)
        for block in blocks:
            scheme = Fp8Scheme(block)
            say(f"{workload.label}: {scheme.describe()} scales")
            rollout = Fp8Rollout(scheme, {n: base[n] for n in names})
            all_tiles = sum(int(np.prod(scheme.tile_grid(shapes[n]))) for n in names)
            dense_s, (dense_sizes, fresh) = _median_seconds(
                partial(_dense, new, names, scheme), repeats
            )
            delta_s, (delta_sizes, stats) = _median_seconds(
                partial(_delta, base, new, rollout), repeats
            )
            adaptive_s, (adaptive_sizes, adaptive) = _median_seconds(
                partial(_delta, base, new, rollout, DENSE_ABOVE), repeats
            )
            q_total = sum(int(np.prod(shapes[n])) for n in names)
            rows.append({
                "workload": workload.label,
                "rate": workload.rate,
                "changed_fraction": fraction,
                "scheme": scheme.describe(),
                "block": block,
                "tiles": all_tiles,
                "tiles_touched": stats.tiles_touched,
                "tiles_touched_fraction": stats.tiles_touched / all_tiles,
                "fp8_changed_fraction": stats.fp8_changed / q_total,
                "scales_changed": stats.scales_changed,
                "delta_payload_bytes": sum(delta_sizes.values()),
                "dense_payload_bytes": sum(dense_sizes.values()),
                "adaptive_payload_bytes": sum(adaptive_sizes.values()),
                "adaptive_construct_seconds": adaptive_s,
                "adaptive_dense_regions": adaptive.dense,
                "dense_above": DENSE_ABOVE,
                "delta_construct_seconds": delta_s,
                "dense_construct_seconds": dense_s,
                "exact": _exact(rollout, fresh),
            })  # fmt: skip
    return {
        "model_bytes": total_bytes,
        "quantized_tensors": len(names),
        "tensors": len(base),
        "repeats": repeats,
        "rows": rows,
    }


def format_fp8_table(result: Mapping[str, Any]) -> str:
    lines = [
        f"model {result['model_bytes'] / 1e9:.2f} GB bf16, {result['quantized_tensors']} of "
        f"{result['tensors']} tensors quantized, medians of {result['repeats']}",
        f"{'workload':<16} {'changed':>8} {'scales':<18} {'tiles touched':>14} {'fp8 chg':>8} "
        f"{'delta MB':>9} {'dense MB':>9} {'adapt MB':>9} {'delta s':>8} {'dense s':>8} "
        f"{'adapt s':>8} exact",
    ]
    for r in result["rows"]:
        lines.append(
            f"{label_of(r):<16} {100 * r['changed_fraction']:7.2f}% {r['scheme']:<18} "
            f"{100 * r['tiles_touched_fraction']:13.1f}% {100 * r['fp8_changed_fraction']:7.2f}% "
            f"{r['delta_payload_bytes'] / 1e6:9.2f} {r['dense_payload_bytes'] / 1e6:9.2f} "
            f"{r['adaptive_payload_bytes'] / 1e6:9.2f} {r['delta_construct_seconds']:8.3f} "
            f"{r['dense_construct_seconds']:8.3f} {r['adaptive_construct_seconds']:8.3f} "
            f"{'yes' if r['exact'] else 'NO'}"
        )
    return "\n".join(lines)
