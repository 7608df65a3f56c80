"""``dcr rl``: the GRPO loop on CPU (FSDP2 trainer, vLLM engine, refits by dcr or dense),
its arguments and its report."""

from __future__ import annotations

import argparse
import json

from dcr.cli.arguments import _err, _fp8_block, _positive, stdout_to_stderr


def add_rl_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rl = sub.add_parser(
        "rl",
        help="a GRPO loop on CPU: FSDP2 trainer, vLLM engine, refits by dcr (or dense)",
        description=(
            "A GRPO-style RL loop with real parts: a small Qwen3 policy (built here, bf16 "
            "weights, fp32 master weights in AdamW) trained by FSDP2 over 2 ranks (gloo) on a "
            "verifiable symbol-sorting task; rollouts sampled by one vLLM CPU engine (TP 1 or "
            "2) with per-request seeds, every rollout tagged with the weight version that "
            "produced it; a refit after every step. --refit delta: dcr's fleet (owners in the "
            "trainer ranks, receivers in the engine's workers, a coordinator, the relay tree "
            "or object storage). --refit dense: the reference, a full checkpoint per step "
            "loaded through vLLM's own loader. The same --seed gives the same run: delta and "
            "dense agree on every step's reward, KL, loss and sampled tokens and on the final "
            "weights. Needs vLLM (.venv-vllm, `pip install 'dcr[rl]'`)."
        ),
    )
    rl.add_argument("--steps", type=_positive, default=20, help="optimizer steps (default 20)")
    rl.add_argument("--refit", choices=["delta", "dense"], default="delta")
    rl.add_argument("--transport", choices=["relay", "s3", "directory"], default="relay",
                    help="delta refits: the relay tree (default), S3 on a SeaweedFS server "
                    "started here, or a directory")  # fmt: skip
    rl.add_argument("--mode", choices=["sync", "async"], default="sync",
                    help="async: a step's rollouts are generated while the previous refit "
                    "streams (staleness 1); the gate closes only to apply and commit")  # fmt: skip
    rl.add_argument("--max-staleness", type=int, default=None,
                    help="most versions a trained-on rollout may lag (default 1 in async "
                    "mode, 0 in sync mode)")  # fmt: skip
    rl.add_argument("--tp", type=int, choices=[1, 2], default=1, help="the engine's TP")
    rl.add_argument("--faults", action="store_true",
                    help="SIGKILL the engine mid-refit twice and a trainer rank once (on "
                    "Ray: ray.kill of their actors); each restarts and recovers")  # fmt: skip
    rl.add_argument(
        "--backend",
        choices=["process", "ray"],
        default="process",
        help="process (default): the fleet as processes on this machine; ray: "
        "a Ray cluster started here (head, a trainer node, two rollout nodes), "
        "the trainer ranks, the vLLM engine, the coordinators and relay nodes as "
        "actors, refits over the relay tree rooted on a rollout node (or S3). "
        "Needs Ray (`pip install 'dcr[ray]'`); on a shared machine run it in a "
        "private network namespace (`unshare -n python -m dcr.ray.netns ...`)",
    )
    rl.add_argument("--rollout-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: the engine serves the FP8 export of every version (dcr fp8 "
                    "export: float8_e4m3fn weights, float32 scales) while the trainer stays "
                    "BF16; delta refits re-quantize only what changed, dense refits load each "
                    "version's export")  # fmt: skip
    rl.add_argument("--fp8-block", type=_fp8_block, default=None, metavar="N|channel",
                    help="FP8 scale tiles of N x N, or 'channel' (default: per output "
                    "channel, the FP8 format vLLM's CPU build computes with)")  # fmt: skip
    rl.add_argument("--prompts", type=_positive, default=None, metavar="N",
                    help="prompts per step (default 8)")  # fmt: skip
    rl.add_argument("--group-size", type=_positive, default=None, metavar="N",
                    help="completions per prompt, GRPO's group (default 8); a smaller batch "
                    "makes a shorter run, a noisier climb")  # fmt: skip
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--dir", default="out/rl", help="run directory (cleared first)")
    rl.add_argument("--against", default=None,
                    help="a dense run's --json output: show its refit seconds and whether "
                    "every step and the final weights agree, and plot it beside")  # fmt: skip
    rl.add_argument("--plot", default=None, help="write reward, KL and refit time as a PNG")
    rl.add_argument(
        "--no-keys",
        dest="keys",
        action="store_false",
        help="run the delta fleet without keys (no CURVE, unsealed payloads; loopback only); "
        "by default <dir>/keys is made and every socket is authenticated and encrypted",
    )
    rl.add_argument("--json", action="store_true", help="print one JSON object")


def run_rl_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from dcr.errors import ConfigError
    from dcr.rl.config import RLConfig
    from dcr.rl.plot import plot_rl
    from dcr.rl.run import RLOptions, compare_runs, format_rl_table, run_rl

    console = Console(stderr=True)  # progress on stderr: stdout stays the JSON
    against = json.loads(Path(args.against).read_text()) if args.against else None
    batch = {"prompts_per_step": args.prompts, "group_size": args.group_size}
    try:
        rl = RLConfig.from_dict({k: v for k, v in batch.items() if v is not None})
        opts = RLOptions(
            steps=args.steps, refit=args.refit, transport=args.transport, mode=args.mode,
            tp=args.tp, faults=args.faults, seed=args.seed, max_staleness=args.max_staleness,
            directory=Path(args.dir), keys=args.keys, backend=args.backend,
            rollout_dtype=args.rollout_dtype, fp8_block=args.fp8_block, rl=rl,
        )  # fmt: skip
        with stdout_to_stderr():
            result = run_rl(opts, say=lambda line: console.print(line, highlight=False))
    except ConfigError as exc:
        _err(f"dcr rl: {exc}")
        return 2
    if args.plot:
        plot_rl(result, Path(args.plot), against)
        result["plot"] = str(Path(args.plot).resolve())
    if against is not None:
        result["against"] = compare_runs(result, against)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_rl_table(result, against), end="")
        if args.plot:
            print(f"plot: {result['plot']}")
    if against is not None and not result["against"]["equal"]:
        return 1
    return 0
