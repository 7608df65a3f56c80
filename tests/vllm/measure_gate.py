"""How long a running vLLM engine's gate stays closed, against the whole refit, in
synchronous and asynchronous RL (run it: ``.venv-vllm/bin/python tests/vllm/measure_gate.py``).

One engine process (Qwen3 of about 60 MB in bf16, or 1.1 GB with ``--large``; TP=1,
plain-weights load format) serves two clients sending greedy requests back to back while its
worker, a fleet receiver, takes ``--refits`` refits in synchronous mode, then (the
coordinator restarted in the other mode) as many in asynchronous mode; each refit changes
``--rate`` of the elements.  For every refit it prints the transition time (the
coordinator's, prepare to the end of the transition), the trainer's publish-to-commit time
and the gate's closed time (no request admitted) and drain time (until the engine was idle);
``--json`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import (
    EngineServer,
    Role,
    Stream,
    coordinator_events,
    load,
    open_trainer,
    write_checkpoints,
    write_fleet,
)

MODEL = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    # The clients' requests are short: 16,384 positions keep the large model's KV cache
    # (40 KB a token) inside the engine's 1 GiB.
    "max_position_embeddings": 16384,
}

LARGE = {
    **MODEL,
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
"""``--large``: the same family at about 1.1 GB in bf16."""


async def measure(
    work: Path, refits: int, rate: float, model: dict[str, Any]
) -> list[dict[str, Any]]:
    fleet = write_fleet(work / "fleet", family="qwen3", tp=1, sync=True, refits=2 * refits,
                        rate=rate, model=model)  # fmt: skip
    cfg = load(fleet)
    (checkpoint,) = write_checkpoints(cfg, 1, work / "checkpoints")
    roles = [Role.start(cfg, "relay", "--node", "node0"),
             Role.start(cfg, "coordinator", "--name", "coordinator")]  # fmt: skip
    engine = None
    rows = []
    try:
        async with AsyncExitStack() as stack:
            trainer = await open_trainer(cfg, stack)
            await trainer.compute(range(1, 2 * refits + 1))
            engine = await anyio.to_thread.run_sync(
                lambda: EngineServer.start(
                    work / "engine", model=checkpoint, tp=1, fleet=fleet, receivers=["r0"],
                    checkpoint_version=0,
                ).wait_ready()
            )  # fmt: skip
            async with anyio.create_task_group() as tg:
                for k in range(1, 2 * refits + 1):
                    if k == refits + 1:  # the same engine, the coordinator in the other mode
                        roles[1].stop()
                        fleet.write_text(fleet.read_text().replace("sync = true", "sync = false"))
                        roles[1] = Role.start(cfg, "coordinator", "--name", "coordinator")
                    stream = Stream(engine, seed=k)
                    await tg.start(stream.run)
                    await anyio.sleep(1.0)  # serving before the refit starts
                    t0 = time.time()
                    record = await trainer.publish(k)
                    published = time.time() - t0
                    label = f"dcr:{record.version}:{record.candidate}"
                    await anyio.to_thread.run_sync(
                        lambda label=label: engine.wait_state(
                            lambda s: s["record"] == label and not s["closed"]
                        )
                    )
                    await stream.stop()
                    cycle = next(c for c in engine.state()["cycles"] if c["version"] == k)
                    rows.append(
                        {"version": k, "sync": k <= refits, "publish_s": published,
                         "closed_s": cycle["closed_s"], "drain_s": cycle["drain_s"]}
                    )  # fmt: skip
    finally:
        if engine is not None:
            engine.stop()
        for role in roles:
            role.stop()
    events = coordinator_events(cfg)
    starts = {e["base"] + 1: e["t"] for e in events if e["event"] == "transition"}
    ends = {e["base"] + 1: e for e in events if e["event"] == "ended"}
    for row in rows:
        k = row["version"]
        row["transition_s"] = ends[k]["t"] - starts[k]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--refits", type=int, default=3, help="refits per mode")
    p.add_argument("--rate", type=float, default=0.05, help="elements changed per refit")
    p.add_argument("--large", action="store_true", help="a model of about 1.1 GB (LARGE)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", type=Path, help="run in this directory and keep it (the events)")
    args = p.parse_args()
    model = LARGE if args.large else MODEL
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        rows = anyio.run(measure, args.keep, args.refits, args.rate, model, backend="asyncio")
    else:
        with tempfile.TemporaryDirectory(prefix="dcr-gate-") as work:
            rows = anyio.run(measure, Path(work), args.refits, args.rate, model, backend="asyncio")
    if args.json:
        print(json.dumps(rows))
        return
    for row in rows:
        mode = "sync " if row["sync"] else "async"
        print(f"v{row['version']} {mode} transition {row['transition_s']:6.3f} s, publish->commit "
              f"{row['publish_s']:6.3f} s, gate closed {row['closed_s']:6.3f} s "
              f"(drain {row['drain_s']:.3f} s)")  # fmt: skip
    for sync in (True, False):
        part = [r for r in rows if r["sync"] is sync]
        print(f"{'synchronous' if sync else 'asynchronous'}: median transition "
              f"{statistics.median(r['transition_s'] for r in part):.3f} s, median gate closed "
              f"{statistics.median(r['closed_s'] for r in part):.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
