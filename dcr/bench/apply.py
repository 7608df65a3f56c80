"""Apply benchmark: in-place apply of one refit against a dense native load.

The model is the ``dcr bench construct`` one (a synthetic llama-family bf16 checkpoint in a
TP=2 training layout).  Each workload (:mod:`dcr.bench.workloads`: chosen elements updated as
``bf16(w * (1 + 0.01 * eps))`` at an element change rate, or a real AdamW step at a learning
rate) makes the next version.  For each receiver kind and each workload, one refit's payloads
are constructed in mixed mode (XOR where the receivers allow it), encoded and decoded as a
receiver decodes them; then

- **apply**: ``Applier.apply_payloads`` of every payload, in declared order, on every rank
  of the receiver, as the receiver engine applies a group of payloads (each all or nothing;
  the next one is checked and planned while the previous one is written); median of
  ``repeats``, the base restored by a dense load between repeats;
- **sparse, dense, adaptive**: the refit built with every tensor as entries, with every
  changed tensor sent whole (a dense overwrite: one block copy per tensor), and as owners
  choose per tensor at a ``dense_above``; the loader's *break-even* is the changed fraction
  from which the dense refit applies faster than the sparse one;
- **dense load**: the same model loaded densely through the same native loader, in the same
  run (the restores and a final load of the new version; median);
- **read**: every resident byte read once (``read_seconds``, a reduction over integer views
  on every core, after each restore; median): the memory-bound floor of a pass over the
  weights.  At 1% a quarter of the 64-byte lines hold a change, and a scattered line costs a
  core several times a streamed one, so an apply costs about one such read;
- **lines**: the fraction of 64-byte lines holding a change (``lines_fraction``).  A sparse
  apply reads and writes each of them, a dense load streams every line once each way, so
  where both run at memory bandwidth a sparse apply's ratio stays above about this fraction
  (53% of the lines at 2.3% of the elements changed uniformly, 72% at 3.9%).

After the last apply every rank's stored bits are compared (integer views) with a dense load of
the new version; a mismatch raises :class:`NotBitExact`.

Receivers: ``torch`` (a :class:`~dcr.adapters.loaders.torch_module.TorchModuleLoader` over a
plain module), ``sharded-tp2``
(:class:`~dcr.adapters.loaders.sharded.ShardedServingLoader`, two serving ranks: fused QKV
and gate/up, vocabulary padding, an fp32 final norm), and ``vllm`` (vLLM's model class through
:class:`~dcr.adapters.loaders.vllm.VllmLoader`, when ``vllm`` is importable; otherwise skipped
with a note).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from dcr.adapters.loaders.sharded import ShardedServingModel
from dcr.adapters.loaders.torch_module import TorchModuleLoader
from dcr.apply import Applier, ApplyConfig, Loader, xor_allowed_across
from dcr.bench.builds import adaptive_build, build_streams, encode_payload
from dcr.bench.construct import synthetic_config
from dcr.bench.workloads import (
    Workload,
    changed_fraction,
    changed_text,
    label_of,
    lines_fraction,
    new_version,
    workloads,
)
from dcr.delta.build import DENSE_ABOVE, BuildConfig
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout, build_plan
from dcr.models.families import random_state_dict
from dcr.models.modules import module_from_state_dict
from dcr.tensors.records import Mode, TensorSpec
from dcr.wire.decode import decode_payload
from dcr.wire.format import Payload

__all__ = ["LOADERS", "NotBitExact", "format_apply_table", "run_apply_bench"]

LOADERS = ("torch", "sharded-tp2", "vllm")
FAMILY = "llama"


class NotBitExact(RuntimeError):
    """The applied result differs from a dense load of the new version (a bug: never ignore)."""


Say = Callable[[str], None]


@contextmanager
def _receivers(
    kind: str, cfg: dict[str, Any], base: Mapping[str, torch.Tensor], threads: int | None
) -> Iterator[list[Applier]]:
    """Every rank of one receiver kind, dense-loaded with ``base`` and prewarmed."""
    catalog = {n: TensorSpec.of(n, t) for n, t in base.items()}
    loaders: list[Loader]
    with ExitStack() as stack:
        if kind == "torch":
            loaders = [TorchModuleLoader(module_from_state_dict(base))]
        elif kind == "sharded-tp2":
            from dcr.adapters.loaders.sharded import ShardedServingLoader

            loaders = [
                ShardedServingLoader(ShardedServingModel(cfg, FAMILY, tp_size=2, tp_rank=r))
                for r in range(2)
            ]
        elif kind == "vllm":
            from dcr.adapters.loaders.vllm import VllmLoader, build_vllm_model, vllm_distributed
            from dcr.models.hf import write_checkpoint

            # vLLM logs to stdout unless told not to configure logging: keep --json clean.
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
            stack.enter_context(vllm_distributed())
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcr-bench-"))
            write_checkpoint(directory, cfg, FAMILY, base)
            loaders = [VllmLoader(build_vllm_model(directory))]
        else:
            raise ValueError(f"unknown receiver kind {kind!r}; expected one of {LOADERS}")
        receivers = [Applier(loader, catalog, ApplyConfig(threads=threads)) for loader in loaders]
        for r in receivers:
            r.dense_load(base)
            r.prewarm()
        yield receivers
        del receivers, loaders


def vllm_available() -> bool:
    """Whether ``vllm`` can be imported here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def _dense(receivers: Sequence[Applier], state_dict: Mapping[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for r in receivers:
        r.dense_load(state_dict)
    return time.perf_counter() - t0


def _read(receivers: Sequence[Applier]) -> float:
    """Seconds to read every resident byte once (a reduction over integer views, on every
    core): what a memory-bound pass over the weights costs on this machine."""
    from dcr.tensors.bits import bits_dtype

    t0 = time.perf_counter()
    for r in receivers:
        for _, t in r.loader.storage_tensors():
            flat = t.detach().reshape(-1)
            if not flat.numel():
                continue
            wide = flat.numel() * flat.element_size() % 8 == 0 and flat.data_ptr() % 8 == 0
            torch.amax(flat.view(torch.int64 if wide else bits_dtype(flat.dtype)))
    return time.perf_counter() - t0


def _apply(
    receivers: Sequence[Applier], payloads: Sequence[Payload], attempt: int
) -> tuple[float, int, int, float]:
    """Seconds, positions written, loader calls and planning seconds (loader calls, checks
    and write plans, before the first write) of applying ``payloads`` on every rank as
    attempt ``attempt`` (a fresh one per repeat: each attempt witnesses the loader anew)."""
    t0 = time.perf_counter()
    written = calls = 0
    plan = 0.0
    for r in receivers:
        for report in r.apply_payloads((p.items for p in payloads), attempt=attempt):
            written += report.written
            calls += report.loader_calls
            plan += sum(item.seconds for item in report.items)
    return time.perf_counter() - t0, written, calls, plan


def _stored_bits(receivers: Sequence[Applier]) -> list[dict[str, torch.Tensor]]:
    from dcr.tensors.bits import bits_dtype

    return [
        {
            name: t.detach().reshape(-1).view(bits_dtype(t.dtype)).clone()
            for name, t in r.loader.storage_tensors()
        }
        for r in receivers
    ]


def _check_bit_exact(
    receivers: Sequence[Applier], applied: list[dict[str, torch.Tensor]], label: str
) -> None:
    from dcr.tensors.bits import bits_dtype, differing

    for rank, (r, snap) in enumerate(zip(receivers, applied, strict=True)):
        for name, t in r.loader.storage_tensors():
            # Integer bit views: +-0 and NaN payloads count as differences.
            diff = differing(snap[name], t.detach().reshape(-1).view(bits_dtype(t.dtype)))
            if diff:
                raise NotBitExact(
                    f"{label}: rank {rank} {name!r} differs from a dense load of the new "
                    f"version at {diff} elements"
                )


def _payloads(
    group: LocalTrainingGroup,
    catalog: Mapping[str, TensorSpec],
    xor_allowed: frozenset[str],
    attempt: int,
    *,
    dense: bool = False,
) -> tuple[list[Payload], int]:
    """One refit's payloads in mixed mode (``dense``: the committed version's dense build),
    encoded and decoded as a receiver decodes them."""
    streams = build_streams(group, mode=Mode.MIXED, xor_allowed=xor_allowed, dense=dense)
    data = [
        encode_payload(bucket, owner=owner, payload_id=seq, attempt=attempt)
        for owner, (it, _) in streams.items()
        for seq, bucket in enumerate(it)
    ]
    decoded = [decode_payload(d, catalog=catalog, xor_allowed=xor_allowed) for d in data]
    decoded.sort(key=lambda p: p.header.order)
    return decoded, sum(len(d) for d in data)


def _timed_applies(
    receivers: Sequence[Applier],
    payloads: Sequence[Payload],
    base: Mapping[str, torch.Tensor],
    repeats: int,
    attempt: int,
) -> tuple[list[float], list[float], list[float], list[float], int, int]:
    """``repeats`` applies of ``payloads``, each from ``base`` restored by a dense load:
    apply, dense-load, read and planning seconds, positions written and loader calls."""
    applies, denses, plans, reads = [], [], [], []
    written = calls = 0
    for repeat in range(repeats):
        denses.append(_dense(receivers, base))
        reads.append(_read(receivers))
        gc.collect()
        seconds, written, calls, plan_s = _apply(receivers, payloads, attempt + repeat)
        applies.append(seconds)
        plans.append(plan_s)
    return applies, denses, reads, plans, written, calls


ALL_DENSE = 1e-12
"""A ``dense_above`` that sends every changed tensor (of at least
:data:`~dcr.delta.owner.DENSE_MIN_ELEMENTS`) dense: the bench's *dense* refit."""


def _choice(dense_items: int, all_dense_items: int) -> str:
    """What the adaptive build sent dense: nothing, every changed tensor, or some."""
    if dense_items == 0:
        return "sparse"
    return "dense" if dense_items == all_dense_items else "mixed"


def break_even(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The changed fraction from which sparse entries cost a loader more to apply than the
    same tensors sent dense (linear between the measured rows; the lowest measured fraction
    when sparse already costs more there); ``None`` when sparse costs less at every row."""
    points = sorted((r["changed_fraction"], r["ratio"] - r["dense_ratio"]) for r in rows)
    for i, (fraction, excess) in enumerate(points):
        if excess < 0:
            continue
        if i == 0:
            return float(fraction)
        f0, e0 = points[i - 1]
        return float(f0 + (fraction - f0) * (-e0) / (excess - e0))
    return None


def run_apply_bench(
    *,
    size_bytes: int = 1_100_000_000,
    rates: Sequence[float | Workload] = (0.01, 0.03, 0.05),
    loaders: Sequence[str] = LOADERS,
    repeats: int = 3,
    threads: int | None = None,
    dense_above: float | None = DENSE_ABOVE,
    seed: int = 0,
    log: Say | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"results": [...], "break_even": {...}, "model": {...},
    "notes": [...]}``.

    ``rates``: the workloads (:class:`~dcr.bench.workloads.Workload`; a number is an element
    change rate).  Each row carries its ``workload`` label and the measured
    ``changed_fraction`` (elements whose stored bits changed); ``rate`` is the change rate,
    or that measured fraction for an AdamW workload.

    Each refit is built three ways and applied: *sparse* (every tensor as entries:
    ``apply_seconds``, ``ratio``, ``payload_bytes``), *dense* (every changed tensor as a
    dense overwrite: ``dense_apply_*``, ``dense_ratio``, ``dense_refit_bytes``) and
    *adaptive*, the owners' choice per tensor at ``dense_above``
    (:attr:`~dcr.delta.build.BuildConfig.dense_above`; ``adaptive_*``, ``adaptive_choice``
    sparse / dense / mixed; timed on its own only when mixed).  ``dense_payload_bytes`` is the
    dense build of the whole model (every element, what a joining receiver gets).
    ``break_even`` holds, per loader, the changed fraction from which dense costs it less to
    apply (:func:`break_even`): the ``dense_above`` that never applies slower than dense.
    ``calibrated_dense_above`` is the lowest of them (the setting for a fleet whose receivers
    run all these loaders on this machine), ``None`` where sparse applied faster at every
    measured rate on every loader.
    """
    say = log or (lambda _msg: None)
    runs = workloads(rates)
    cfg = synthetic_config(size_bytes)
    say(f"building a {cfg['num_hidden_layers']}-layer synthetic llama model")
    base = random_state_dict(cfg, FAMILY, seed=seed)
    catalog = {n: TensorSpec.of(n, t) for n, t in base.items()}
    checkpoint_bytes = sum(s.nbytes for s in catalog.values())
    plan = build_plan(catalog, TrainLayout(tp=2), family=FAMILY, config=cfg)
    group = LocalTrainingGroup(plan, plan.slice(base), config=BuildConfig(dense_above=None))
    _, dense_payload_bytes = _payloads(group, catalog, frozenset(), attempt=0, dense=True)
    say(f"dense payloads of the model: {dense_payload_bytes:,} bytes")
    notes: list[str] = []
    results: list[dict[str, Any]] = []
    even: dict[str, float | None] = {}
    for kind in loaders:
        if kind == "vllm" and not vllm_available():
            notes.append("vllm: skipped, vllm is not installed in this environment")
            say(notes[-1])
            continue
        rows: list[dict[str, Any]] = []
        with _receivers(kind, cfg, base, threads) as receivers:
            xor_allowed = xor_allowed_across(receivers)
            _dense(receivers, base)  # warm the pages and the loader
            for i, workload in enumerate(runs):
                row = _measure(
                    kind, receivers, group, plan, base, catalog, workload, i,
                    xor_allowed=xor_allowed, repeats=repeats, dense_above=dense_above, seed=seed,
                )  # fmt: skip
                rows.append(row | {"dense_payload_bytes": dense_payload_bytes})
                say(_row_text(rows[-1]))
        even[kind] = break_even(rows)
        results.extend(rows)
        gc.collect()
    found = [f for f in even.values() if f is not None]
    return {
        "results": results,
        "break_even": even,
        "calibrated_dense_above": round(min(found), 4) if found else None,
        "model": {
            "checkpoint_bytes": checkpoint_bytes,
            "layers": cfg["num_hidden_layers"],
            "training_tp": 2,
            "repeats": repeats,
            "threads": threads or min(os.cpu_count() or 1, 8),
            "dense_above": dense_above,
            "torch": torch.__version__,
        },
        "notes": notes,
    }


def _measure(
    kind: str,
    receivers: Sequence[Applier],
    group: LocalTrainingGroup,
    plan: Any,
    base: Mapping[str, torch.Tensor],
    catalog: Mapping[str, TensorSpec],
    workload: Workload,
    i: int,
    *,
    xor_allowed: frozenset[str],
    repeats: int,
    dense_above: float | None,
    seed: int,
) -> dict[str, Any]:
    """One row: the workload's refit built sparse, dense and adaptive, each applied
    ``repeats`` times from ``base`` and checked bit for bit against a dense load."""
    new = new_version(base, workload, seed + 1 + i)
    changed = changed_fraction(base, new)
    group.stage(plan.slice(new))
    builds: dict[str, tuple[list[Payload], int]] = {}
    for name, above in (("sparse", None), ("dense", ALL_DENSE), ("adaptive", dense_above)):
        if name == "adaptive" and above is None:
            continue
        with adaptive_build(group, above):
            builds[name] = _payloads(group, catalog, xor_allowed, i + 1)
    group.discard()

    def spans(name: str) -> int:
        return sum(1 for p in builds[name][0] for it in p.items if it.span is not None)

    def dense_items(name: str) -> int:
        """Items a build sent dense: its span items beyond the sparse build's own (a run of
        consecutive changed elements is a span item in every build)."""
        return spans(name) - spans("sparse")

    timed: dict[str, tuple[list[float], list[float]]] = {}
    applied: list[dict[str, torch.Tensor]] = []
    sparse_stats: tuple[list[float], list[float], int, int] = ([], [], 0, 0)
    denses: list[float] = []
    choice = _choice(dense_items("adaptive"), dense_items("dense")) if "adaptive" in builds else ""
    for n, name in enumerate(("sparse", "dense", "adaptive")):
        if name not in builds or (name == "adaptive" and choice != "mixed"):
            continue
        applies, d, reads, plans, written, calls = _timed_applies(
            receivers, builds[name][0], base, repeats, (i + 1) * 1000 + 300 * n
        )
        denses += d
        timed[name] = (applies, reads)
        if name == "sparse":
            applied = _stored_bits(receivers)
            sparse_stats = (reads, plans, written, calls)
        else:
            _check_bit_exact(receivers, applied, f"{kind} at {workload.label}, {name}")
    denses.append(_dense(receivers, new))
    _check_bit_exact(receivers, applied, f"{kind} at {workload.label}")
    reads, plans, written, calls = sparse_stats
    payloads, payload_bytes = builds["sparse"]
    entries = sum(item.count for p in payloads for item in p.items)
    apply_s, dense_s = statistics.median(timed["sparse"][0]), statistics.median(denses)
    dense_apply_s = statistics.median(timed["dense"][0])
    row: dict[str, Any] = {
        "rate": workload.rate if workload.rate is not None else changed,
        "workload": workload.label,
        "changed_fraction": changed,
        "lines_fraction": lines_fraction(base, new),
        "loader": kind,
        "apply_seconds": apply_s,
        "dense_load_seconds": dense_s,
        "ratio": apply_s / dense_s,
        "read_seconds": statistics.median(reads),
        "entries": entries,
        "written": written,
        "ns_per_entry": apply_s / entries * 1e9 if entries else 0.0,
        "loader_calls": calls,
        "plan_seconds": statistics.median(plans),
        "payload_bytes": payload_bytes,
        "dense_apply_seconds": dense_apply_s,
        "dense_ratio": dense_apply_s / dense_s,
        "dense_refit_bytes": builds["dense"][1],
        "dense_items": dense_items("dense"),
        "ranks": len(receivers),
        "bit_exact": True,
        **({"adamw_lr": workload.value} if workload.kind == "adamw" else {}),
    }
    if choice:
        source = {"sparse": "sparse", "dense": "dense", "mixed": "adaptive"}[choice]
        adaptive_s = statistics.median(timed[source][0])
        row |= {
            "dense_above": dense_above,
            "adaptive_choice": choice,
            "adaptive_apply_seconds": adaptive_s,
            "adaptive_ratio": adaptive_s / dense_s,
            "adaptive_payload_bytes": builds["adaptive"][1],
            "adaptive_dense_items": dense_items("adaptive"),
        }
    return row


def _row_text(r: Mapping[str, Any]) -> str:
    text = (
        f"{r['loader']} {r['workload']} ({r['changed_fraction']:.2%} changed): sparse "
        f"{r['apply_seconds']:.3f} s ({r['ratio']:.2f}x), dense {r['dense_apply_seconds']:.3f} s "
        f"({r['dense_ratio']:.2f}x) of a dense load {r['dense_load_seconds']:.3f} s"
    )
    if "adaptive_choice" in r:
        text += f", adaptive: {r['adaptive_choice']} ({r['adaptive_ratio']:.2f}x)"
    return text + ", bit-exact"


def _lines_text(r: Mapping[str, Any]) -> str:
    """The row's 64-byte lines holding a change (``-`` for a row written before)."""
    return f"{r['lines_fraction']:.0%}" if "lines_fraction" in r else "-"


def format_apply_table(result: dict[str, Any]) -> str:
    """A fixed-width table of :func:`run_apply_bench` results: per workload and loader the
    sparse and the dense refit side by side (apply time over a dense load, bytes), the
    adaptive choice, and each loader's break-even."""
    model = result["model"]
    lines = [
        f"synthetic llama model: {model['checkpoint_bytes'] / 1e9:.2f} GB bf16, median of "
        f"{model['repeats']} runs, {model['threads']} apply threads; ratio = apply time over "
        "a dense load through the same loader",
        f"{'workload':>15} {'changed':>8} {'lines':>6} {'loader':>12} {'entries':>12} "
        f"{'load s':>7} "
        f"{'sparse s':>8} {'ratio':>6} {'MB':>7} {'dense s':>8} {'ratio':>6} {'MB':>7} "
        f"{'adaptive':>8} {'ratio':>6} {'MB':>7} {'ns/entry':>8}",
    ]
    for r in result["results"]:
        adaptive = (
            f"{r['adaptive_choice']:>8} {r['adaptive_ratio']:>6.2f} "
            f"{r['adaptive_payload_bytes'] / 1e6:>7.1f}"
            if "adaptive_choice" in r
            else f"{'-':>8} {'-':>6} {'-':>7}"
        )
        lines.append(
            f"{label_of(r):>15} {changed_text(r):>8} {_lines_text(r):>6} {r['loader']:>12} "
            f"{r['entries']:>12,} "
            f"{r['dense_load_seconds']:>7.4f} {r['apply_seconds']:>8.4f} {r['ratio']:>6.2f} "
            f"{r['payload_bytes'] / 1e6:>7.1f} {r['dense_apply_seconds']:>8.4f} "
            f"{r['dense_ratio']:>6.2f} {r['dense_refit_bytes'] / 1e6:>7.1f} {adaptive} "
            f"{r['ns_per_entry']:>8.1f}"
        )
    if result["results"]:
        whole = result["results"][0]["dense_payload_bytes"]
        lines.append(
            f"dense: every changed tensor sent whole; the whole model dense is {whole / 1e6:.1f} "
            f"MB; adaptive: the owners' choice per tensor at dense_above = {model['dense_above']}"
        )
        lines.append(
            "lines: the 64-byte lines holding a change, which a sparse apply reads and writes "
            "(at memory bandwidth its ratio stays above about this fraction)"
        )
    for loader, fraction in result.get("break_even", {}).items():
        lines.append(
            f"{loader}: dense applies faster from {fraction:.1%} changed"
            if fraction is not None
            else f"{loader}: sparse applies faster at every measured rate"
        )
    if result.get("calibrated_dense_above") is not None:
        lines.append(
            "calibrated for receivers with these loaders on this machine: "
            f"[trainer] dense_above = {result['calibrated_dense_above']} in the fleet file "
            "(BuildConfig.dense_above), or higher where link bytes cost more than apply time"
        )
    lines.extend(result.get("notes", []))
    return "\n".join(lines)
