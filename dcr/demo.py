"""``dcr demo``: refit two serving layouts from a TP=2 x DP=2 trainer, checked bit for bit.

A synthetic llama-family model (a few hundred MB of bf16) is sliced for a Megatron-style
trainer with TP=2 and DP=2 (four owners).  Two receivers with different serving TP -- a TP=1
engine (one rank, ``r0``) and a TP=2 engine (two ranks, ``r1`` and ``r2``), both vLLM-like
sharded reference models with fused QKV / gate-up, vocabulary padding and a float32 norm --
hold version 0.  Each refit perturbs about ``rate`` of the elements and runs one transition of
the refit protocol (coordinator, owners, receivers on in-memory adapters, commit by
compare-and-set); afterwards every parameter bit of every rank is compared with a fresh model
dense-loaded from the new version.

With ``faults=True`` the refits after the first one go wrong on purpose: a receiver killed
mid-refit (the overwrite retry repairs the survivors, the restarted receiver restores the
committed version by dense refit and rejoins), lost / corrupted / duplicated / reordered
payloads, a lost commit reply, and a coordinator failover.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dcr.adapters.sources import StateDictSource
from dcr.delta.layout import TrainLayout
from dcr.delta.owner import BuildConfig
from dcr.local import LocalRefit, RefitConfig, RefitReport
from dcr.testing.compare import module_bit_mismatches
from dcr.testing.faults import Faults
from dcr.testing.models import canonical_shapes, random_state_dict, tiny_config
from dcr.testing.reference import ShardedReferenceLoader, ShardedReferenceModel
from dcr.testing.updates import perturb

__all__ = ["FAULT_PLAN", "demo_config", "run_demo"]

SERVING_TP = (1, 2)

FAULT_PLAN: tuple[tuple[str, Faults], ...] = (
    (
        "receiver r1 (TP=2, rank 0) killed after applying 2 payloads",
        Faults(kill_receiver="r1", kill_receiver_after=2),
    ),
    (
        "payloads lost, corrupted, duplicated and reordered",
        Faults(drop=1, corrupt=1, duplicate=2, reorder=True),
    ),
    (
        "the commit reply is lost (outcome unknown until read_commit)",
        Faults(lose_commit_reply=True),
    ),
    (
        "the coordinator dies mid-attempt; a new one takes over",
        Faults(failover=True, failover_after=3),
    ),
)
"""What ``--faults`` injects into refits 2, 3, ... (cycling)."""


def demo_config(size_bytes: int) -> dict[str, Any]:
    """A llama-family config of roughly ``size_bytes`` in bf16 (at least two layers)."""
    layers = 2
    while True:
        cfg = tiny_config(
            "llama",
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
        )
        total = sum(2 * int(np.prod(s)) for s in canonical_shapes(cfg, "llama").values())
        if total >= size_bytes or layers >= 64:
            return cfg
        layers += 1


def _engines(cfg: dict[str, Any], state: dict[str, Any]) -> list[ShardedReferenceModel]:
    """One reference model per serving rank, dense-loaded with ``state``."""
    models = []
    for tp in SERVING_TP:
        for rank in range(tp):
            m = ShardedReferenceModel(cfg, "llama", tp_size=tp, tp_rank=rank)
            ShardedReferenceLoader(m).dense_load(state)
            models.append(m)
    return models


def _row(report: RefitReport, exact: bool, fault: str) -> dict[str, Any]:
    s = report.seconds
    return {
        "version": report.version,
        "attempts": [a.mode.value for a in report.attempts],
        "fault": fault,
        "faults": dataclasses.asdict(report.faults),
        "changed_elements": report.changed_elements,
        "payload_bytes": report.payload_bytes,
        "num_payloads": report.num_payloads,
        "checkpoint_fraction": report.checkpoint_fraction,
        "bytes_per_changed_element": report.bytes_per_changed_element,
        "xor_items": report.xor_items,
        "overwrite_items": report.overwrite_items,
        "seconds": {
            k: s[k] for k in ("source", "construct", "decode", "apply", "transition", "total")
        },
        "bit_exact": exact,
    }


def run_demo(
    *,
    size_bytes: int = 300_000_000,
    refits: int = 5,
    rate: float = 0.01,
    seed: int = 0,
    faults: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the demo; returns a summary dict with ``bit_exact`` and one row per refit."""
    console = Console(stderr=True, quiet=quiet, width=max(Console(stderr=True).width, 118))
    cfg = demo_config(size_bytes)
    t0 = time.perf_counter()
    with console.status("building the synthetic model and the receivers"):
        state = random_state_dict(cfg, "llama", seed=seed)
        ckpt = sum(t.numel() * t.element_size() for t in state.values())
        source = StateDictSource(state, layout=TrainLayout(tp=2, dp=2), family="llama", config=cfg)
        engines = _engines(cfg, state)
        # Buckets of 16 MiB give several payloads per owner, so faults can strike mid-stream.
        config = RefitConfig(build=BuildConfig(chunk_bytes=8 << 20, bucket_bytes=16 << 20))
        refit = LocalRefit(source, [ShardedReferenceLoader(m) for m in engines], config=config)
    console.print(
        f"model: {cfg['num_hidden_layers']} layers, {ckpt / 1e6:.0f} MB bf16 | trainer: TP=2 x "
        f"DP=2 ({len(source.plan.owners)} owners) | receivers: r0 = serving TP=1, r1 + r2 = "
        f"serving TP=2 | setup {time.perf_counter() - t0:.1f} s"
    )
    rows = []
    table = Table(title="dcr demo: refits through the protocol and the native loader")
    for col in ("v", "attempts", "changed", "payload", "of ckpt", "B/chg", "construct s",
                "decode s", "apply s", "total s", "exact"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        overall = progress.add_task("refits", total=refits)
        stage = progress.add_task("starting", total=None)
        for v in range(1, refits + 1):
            fault, plan = "", Faults()
            if faults and v > 1:
                fault, plan = FAULT_PLAN[(v - 2) % len(FAULT_PLAN)]
                console.print(f"[yellow]refit {v}: {fault}")

            def on_progress(name: str, done: int, total: int, v: int = v) -> None:
                label = f"v{v} {name}" + (f": {done} payloads applied" if total < 0 else "")
                progress.update(stage, description=label, total=None)

            new = perturb(state, rate=rate, seed=seed * 1000 + v)
            report = refit.refit(new, faults=plan, progress=on_progress)
            progress.update(stage, description=f"v{v} dense check")
            fresh = _engines(cfg, new)
            bad = [
                f"rank {i}: {n}"
                for i, (a, b) in enumerate(zip(engines, fresh, strict=True))
                for n in module_bit_mismatches(a, b)
            ]
            del fresh
            row = _row(report, not bad, fault)
            rows.append(row)
            sec = row["seconds"]
            table.add_row(
                str(v),
                " → ".join(row["attempts"]),
                f"{report.changed_elements:,}",
                f"{report.payload_bytes / 1e6:.2f} MB",
                f"{report.checkpoint_fraction:.2%}",
                f"{report.bytes_per_changed_element:.2f}",
                f"{sec['construct']:.2f}",
                f"{sec['decode']:.2f}",
                f"{sec['apply']:.2f}",
                f"{sec['total']:.2f}",
                "[green]✓" if not bad else f"[red]✗ ({len(bad)})",
            )
            if fault:
                f = dataclasses.asdict(report.faults)
                retry = report.attempts[-1]
                n = len(report.attempts)
                console.print(
                    f"  → {n} attempt{'s' if n != 1 else ''} ({' → '.join(row['attempts'])}); "
                    f"killed {f.get('killed') or '-'}, restarted by dense refit "
                    f"{f.get('restarted') or '-'}; last attempt required {list(retry.receivers)}"
                )
            if bad:
                console.print(f"[red]version {v}: mismatching tensors: {bad[:5]}")
            state = new
            progress.advance(overall)
    refit.close()
    console.print(table)
    exact = all(r["bit_exact"] for r in rows)
    console.print(
        "[green]every receiver rank is bit-identical to a dense load of every version"
        if exact
        else "[red]bit mismatch: see the table above"
    )
    return {
        "bit_exact": exact,
        "checkpoint_bytes": ckpt,
        "layers": cfg["num_hidden_layers"],
        "owners": len(source.plan.owners),
        "receiver_ranks": len(engines),
        "faults": faults,
        "refits": rows,
    }
