"""The ``dcr`` command line: benchmarks and the demo.

Every subcommand prints a human-readable report; ``--json`` prints one JSON object instead
(progress goes to stderr, so stdout stays machine-readable).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _modes(text: str) -> list[str]:
    modes = [m.strip().upper() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("X", "P", "F")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are X, P and F, got {text!r}")
    return modes


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    from dcr import __version__

    p = argparse.ArgumentParser(
        prog="dcr",
        description="Bit-exact delta-compressed refit: benchmarks and a demo.",
    )
    p.add_argument("--version", action="version", version=f"dcr {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark (see `dcr bench -h`)")
    bsub = bench.add_subparsers(dest="bench", required=True)

    codec = bsub.add_parser(
        "codec",
        help="XOR vs overwrite compressed sizes (paper Table 2 workload)",
        description=(
            "20,000,000 standard-normal bf16 values (seed 42) plus FP32 Gaussian noise of std a "
            "(seed 44), rounded to bf16; the changed words are compressed with zstd as "
            "overwrite values, XOR masks, and byte-planed XOR masks."
        ),
    )
    codec.add_argument("--n", type=_positive, default=20_000_000, help="values (default 20M)")
    codec.add_argument(
        "--amplitudes", type=_floats, default=[1e-4, 1e-3, 1e-2], help="noise stds a"
    )
    codec.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    codec.add_argument("--json", action="store_true", help="print one JSON object")

    cons = bsub.add_parser(
        "construct",
        help="delta construction time and bytes, modes X / P / F (paper Table 3)",
        description=(
            "A synthetic llama-family bf16 model in a TP=2 training layout; chosen elements are "
            "updated as bf16(w*(1+0.01*eps)). X = projection + mixed XOR/overwrite, P = "
            "projection + overwrite only, F = full conversion + overwrite only. Reports "
            "construction seconds (median of --repeats), payload bytes, bytes per changed "
            "element and a memcpy bandwidth reference measured in the same run."
        ),
    )
    cons.add_argument("--size-gb", type=float, default=1.1, help="model size (default 1.1 GB)")
    cons.add_argument(
        "--rates", type=_floats, default=[0.01, 0.03, 0.05], help="element change rates"
    )
    cons.add_argument("--modes", type=_modes, default=["X", "P", "F"], help="subset of X,P,F")
    cons.add_argument("--repeats", type=_positive, default=3, help="runs per point (median)")
    cons.add_argument("--tp", type=_positive, default=2, help="training tensor parallelism")
    cons.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser(
        "demo",
        help="refit two serving layouts from a TP=2 x DP=2 trainer, checked bit for bit",
        description=(
            "Builds a synthetic llama-family model, slices it for a TP=2 x DP=2 trainer, and "
            "refits two receivers with different serving TP (1 and 2) through the refit "
            "protocol and their native loaders for several versions; after each refit every "
            "parameter bit is compared with a dense load of the new version. Exits non-zero "
            "on any mismatch."
        ),
    )
    demo.add_argument("--size-mb", type=float, default=300.0, help="model size (default 300)")
    demo.add_argument("--refits", type=_positive, default=5, help="versions to refit")
    demo.add_argument("--rate", type=float, default=0.01, help="element change rate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--faults",
        action="store_true",
        help="inject failures into refits 2..N: a receiver killed mid-refit, lost/corrupted/"
        "duplicated/reordered payloads, a lost commit reply, a coordinator failover",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bench_codec(args: argparse.Namespace) -> int:
    from dcr.bench.codec import format_codec_table, run_codec_bench

    result = run_codec_bench(n=args.n, amplitudes=tuple(args.amplitudes), level=args.level)
    print(json.dumps(result) if args.json else format_codec_table(result))
    return 0


def _bench_construct(args: argparse.Namespace) -> int:
    from dcr.bench.construct import format_construct_table, run_construct_bench

    result = run_construct_bench(
        size_bytes=int(args.size_gb * 1e9),
        rates=args.rates,
        modes=args.modes,
        repeats=args.repeats,
        tp=args.tp,
        log=_err,
    )
    print(json.dumps(result) if args.json else format_construct_table(result))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from dcr.demo import run_demo

    result: dict[str, Any] = run_demo(
        size_bytes=int(args.size_mb * 1e6),
        refits=args.refits,
        rate=args.rate,
        seed=args.seed,
        faults=args.faults,
        quiet=args.json,
    )
    if args.json:
        print(json.dumps(result))
    return 0 if result["bit_exact"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _bench_codec(args) if args.bench == "codec" else _bench_construct(args)
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
