"""``dcr demo``: a refit fleet of real processes, every receiver checked bit for bit.

A TP=2 x DP=2 trainer (four owner processes in a gloo process group) trains a synthetic
llama-family model of a few hundred MB; two rollout nodes serve it, one engine at serving
TP=1 (``r0``) and one at TP=2 (``r1``, ``r2``), each rank its own process, behind a relay
tree of two relay-node processes; a coordinator process and a standby; a SQLite commit store
on disk.  Receivers start empty and restore version 0 by a dense refit the owners send over
the relay tree; then each optimizer step is refit in place.  After every commit each receiver
reports digests of its parameter bits, compared with a dense load of that version.  Every
socket is CURVE-authenticated and encrypted and every payload sealed with the fleet's key
(``<dir>/keys``) unless ``keys=False``.

With ``faults=True`` (or ``"plan"``) refits 2, 3, ... each SIGKILL one process mid-refit: a
receiver, a trainer rank (the whole trainer restarts), the active coordinator (the standby
takes over with the next epoch) and a relay node -- and show how each transition recovered;
``faults="random"`` draws the role of each refit (seeded by ``seed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dcr.fleet.config import load_fleet
from dcr.fleet.faults import fault_plan
from dcr.fleet.launcher import Launcher

__all__ = ["demo_fleet_file", "run_demo"]


def demo_fleet_file(
    directory: Path,
    *,
    size_mb: float = 300.0,
    refits: int = 5,
    rate: float = 0.01,
    seed: int = 0,
    model_overrides: dict[str, Any] | None = None,
    chunk_mb: float = 8.0,
    bucket_mb: float = 16.0,
    extra: str = "",
    keys: bool = True,
) -> Path:
    """Write the demo's fleet file into ``directory`` and return its path; ``extra`` is
    TOML appended to it (more sections).  With ``keys`` the fleet authenticates and encrypts
    every socket and seals its payloads with the key directory ``<directory>/keys``, made
    here when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    overrides = "".join(
        f"{k} = {v!r}\n" if not isinstance(v, bool) else f"{k} = {str(v).lower()}\n"
        for k, v in (model_overrides or {}).items()
    )
    text = f"""# The dcr demo fleet: every role is its own process.
[fleet]
name = "demo"
run_dir = "run"
{'keys = "keys"' if keys else ""}

[model]
family = "llama"
size_mb = {size_mb}
seed = {seed}
rate = {rate}
refits = {refits}

[model.overrides]
{overrides}
[trainer]
tp = 2
dp = 2
chunk_mb = {chunk_mb}
bucket_mb = {bucket_mb}

[coordinator]
standbys = 1
lease_s = 3.0

[commit_store]
kind = "sqlite"
path = "commit.db"

[control]
kind = "zmq"

[transport]
kind = "relay"
fanout = 2

[[rollout]]
name = "node0"
receivers = [{{ name = "r0", tp = 1, rank = 0 }}]

[[rollout]]
name = "node1"
receivers = [{{ name = "r1", tp = 2, rank = 0 }}, {{ name = "r2", tp = 2, rank = 1 }}]
"""
    path = directory / "fleet.toml"
    path.write_text(text + extra)
    load_fleet(path).ensure_keys()
    return path


def run_demo(
    *,
    directory: Path = Path("out/demo"),
    size_mb: float = 300.0,
    refits: int = 5,
    rate: float = 0.01,
    seed: int = 0,
    faults: bool | str = False,
    quiet: bool = False,
    model_overrides: dict[str, Any] | None = None,
    chunk_mb: float = 8.0,
    bucket_mb: float = 16.0,
    deadline_s: float = 3600.0,
    keys: bool = True,
) -> dict[str, Any]:
    """Run the demo fleet; returns the launcher's report (``bit_exact``, one row per refit)."""
    console = Console(stderr=True, quiet=quiet, width=max(Console(stderr=True).width, 110))
    path = demo_fleet_file(
        directory, size_mb=size_mb, refits=refits, rate=rate, seed=seed,
        model_overrides=model_overrides, chunk_mb=chunk_mb, bucket_mb=bucket_mb, keys=keys,
    )  # fmt: skip
    cfg = load_fleet(path)
    plan = fault_plan(cfg, "plan" if faults is True else (faults or None), seed)
    launcher = Launcher(cfg, faults=plan, say=console.print, deadline_s=deadline_s)
    ckpt = launcher.model.checkpoint_bytes
    console.print(
        f"model: {launcher.model.config['num_hidden_layers']} layers, {ckpt / 1e6:.0f} MB bf16 | "
        f"trainer: TP=2 x DP=2 (4 owner processes, gloo) | rollout: node0 r0 (TP=1), node1 "
        f"r1 + r2 (TP=2) | relay tree of 2 nodes | coordinator + standby | SQLite on disk | "
        + ("CURVE on every socket, keyed payload seals" if keys else "no keys (loopback only)")
    )
    if plan:
        for f in plan:
            console.print(f"[yellow]refit {f.version}: SIGKILL {f.target} after its first "
                          f"'{f.after}' event of that refit")  # fmt: skip
    report = launcher.run()
    table = Table(title="dcr demo: a fleet of processes, refit by refit")
    for col in ("v", "attempts", "payload", "of ckpt", "V_cross / V_payload", "seconds",
                "killed", "checked", "exact"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    for row in report["refits"]:
        cross = (
            f"{row['v_cross'] / 1e6:.2f} / {row['v_payload'] / 1e6:.2f} MB"
            if row["v_cross"] is not None
            else "-"
        )
        table.add_row(
            str(row["version"]),
            " → ".join(row["attempts"]) or "-",
            f"{row['payload_bytes'] / 1e6:.2f} MB",
            f"{row['payload_bytes'] / ckpt:.2%}",
            cross,
            f"{row['seconds']:.2f}",
            ", ".join(row["killed"]) or "-",
            str(len(row["receivers_checked"])),
            "[green]✓" if row["bit_exact"] else "[red]✗",
        )
    console.print(table)
    console.print(
        f"{report['processes']} processes, {report['starts']} starts, "
        f"{len(report['sigkills'])} SIGKILLs, {report['seconds']:.0f} s"
    )
    console.print(
        "[green]every receiver rank is bit-identical to a dense load of every version"
        if report["bit_exact"]
        else f"[red]bit mismatch: {report['mismatches'][:5]}"
    )
    return report
