"""``dcr bench``: the benchmark subcommands (codec, construct, apply, dense, proof, relay,
refit, project, fp8), their arguments and their reports."""

from __future__ import annotations

import argparse
import json
import sys

from dcr.cli.arguments import (
    _backends,
    _err,
    _floats,
    _fp8_blocks,
    _fraction,
    _loaders,
    _modes,
    _positive,
    _transports,
    _workloads,
    stdout_to_stderr,
)

_WORKLOADS_HELP = (
    "comma-separated workloads (default 0.01,0.03,0.05): a fraction in (0, 1] is an element "
    "change rate (each element chosen with that probability and updated as "
    "bf16(w*(1+0.01*eps))); adamw:LR is one real torch AdamW step at learning rate LR on fp32 "
    "masters of the weights with seeded normal gradients (std 1e-3 of each tensor's RMS), cast "
    "back to bf16, e.g. 0.001,0.15,1.0,adamw:1e-6,adamw:1e-5,adamw:1e-4"
)


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``dcr bench`` and its subcommands."""
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
    codec.add_argument(
        "--floor",
        action="store_true",
        help=(
            "instead: whole payloads (format 1 and 2, XOR and ULP values) against the order-0 "
            "floor of gap-coded positions + XOR masks, 1/3/5%% of --n weights updated as "
            "bf16(w*(1+0.01*eps))"
        ),
    )
    codec.add_argument("--repeats", type=_positive, default=1, help="--floor: runs (best)")
    codec.add_argument("--json", action="store_true", help="print one JSON object")

    cons = bsub.add_parser(
        "construct",
        help="delta construction time and bytes, modes X / P / F (paper Table 3)",
        description=(
            "A synthetic llama-family bf16 model in a TP=2 training layout; each workload of "
            "--rates makes the next version (chosen elements updated as bf16(w*(1+0.01*eps)), "
            "or one AdamW step); each row reports its workload label and the measured "
            "changed_fraction (elements whose stored bits changed). X = projection + mixed "
            "XOR/overwrite, P = "
            "projection + overwrite only, F = full conversion + overwrite only. Reports "
            "construction seconds (median of --repeats), payload bytes, bytes per changed "
            "element, the order-0 entropy floor of gap-coded positions + XOR masks of the "
            "changed elements (entropy_floor_bytes) and vs_memcpy: the median over runs of "
            "construction throughput divided by a single-thread memcpy rate measured just "
            "before that run: the faster of a warm 256 MiB buffer copy "
            "(buffer_copy_gb_per_s) and a copy of the bytes construction reads "
            "(source_copy_gb_per_s); bandwidth_reference_gb_per_s is the median of the faster. "
            "With --dense-above each construction is also timed with BuildConfig.dense_above "
            "(adaptive_payload_bytes, adaptive_construct_seconds, adaptive_dense_tensors) and "
            "the dense build of the model (every element) is encoded once "
            "(dense_payload_bytes, dense_construct_seconds)."
        ),
    )
    cons.add_argument("--size-gb", type=float, default=1.1, help="model size (default 1.1 GB)")
    cons.add_argument(
        "--rates", type=_workloads, default=[0.01, 0.03, 0.05], metavar="WORKLOADS",
        help=_WORKLOADS_HELP,
    )  # fmt: skip
    cons.add_argument("--modes", type=_modes, default=["X", "P", "F"], help="subset of X,P,F")
    cons.add_argument("--repeats", type=_positive, default=3, help="runs per point (median)")
    cons.add_argument("--tp", type=_positive, default=2, help="training tensor parallelism")
    cons.add_argument(
        "--relative",
        choices=["ulp", "xor"],
        default="ulp",
        help="mode X's relative encoding: ULP deltas (default) or XOR masks (the paper's)",
    )
    cons.add_argument(
        "--chunk-mb", type=_positive, default=16, help="tensors compared together (MiB)"
    )
    cons.add_argument(
        "--bucket-mb",
        type=_positive,
        default=64,
        help="input bytes per payload (MiB); small enough next to the model that encoding "
        "overlaps the comparison of the next bucket",
    )
    cons.add_argument(
        "--dense-above",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="also time each construction with BuildConfig.dense_above = FRACTION (tensors "
        "changed at least that much are sent dense) and encode the dense build of the model "
        "once: sparse, adaptive and dense payload bytes side by side",
    )
    cons.add_argument("--json", action="store_true", help="print one JSON object")

    app = bsub.add_parser(
        "apply",
        help="in-place apply of one refit against a dense native load",
        description=(
            "The `bench construct` model; for each workload of --rates, one refit's payloads "
            "(mixed mode, encoded and decoded) are applied with Applier.apply_payloads on every "
            "rank of each receiver (torch: a TorchModuleLoader module; sharded-tp2: the sharded "
            "reference loader at serving TP 2; vllm: vLLM's model class, skipped when vllm is "
            "not installed) and timed against a dense native load through the same loader in the "
            "same run (medians of --repeats), and against a read of every resident byte (the "
            "memory-bound floor of a pass over the weights). Each refit is built three ways: "
            "sparse (every tensor as entries), dense (every changed tensor sent whole) and "
            "adaptive (the owners' choice per tensor at --dense-above), shown side by side; "
            "each loader's break-even is the changed fraction from which dense applies faster "
            "(the dense_above that is never slower than dense); the lowest of them is printed "
            "as the fleet setting for receivers with these loaders on this machine "
            "([trainer] dense_above). The applied bits are checked "
            "against the dense load of the new version; a mismatch fails the run. Each row "
            "reports its workload label and the measured changed_fraction."
        ),
    )
    app.add_argument("--size-gb", type=float, default=1.1, help="model size (default 1.1 GB)")
    app.add_argument(
        "--rates", type=_workloads, default=[0.01, 0.03, 0.05], metavar="WORKLOADS",
        help=_WORKLOADS_HELP,
    )  # fmt: skip
    app.add_argument(
        "--loaders",
        type=_loaders,
        default=["torch", "sharded-tp2", "vllm"],
        help="subset of torch,sharded-tp2,vllm",
    )
    app.add_argument("--repeats", type=_positive, default=3, help="runs per point (median)")
    app.add_argument("--threads", type=_positive, default=None, help="apply threads")
    app.add_argument(
        "--dense-above",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="the adaptive refit's BuildConfig.dense_above: tensors changed at least that much "
        "are sent dense (default: the library's default, dcr.delta.build.DENSE_ABOVE)",
    )
    app.add_argument("--json", action="store_true", help="print one JSON object")

    dense = bsub.add_parser(
        "dense",
        help="memory and time of a dense refit (restoring a receiver from the owners)",
        description=(
            "The `bench construct` model in a TP=--tp training layout: every owner builds its "
            "dense buckets (overwrite records of every element) and encodes them as the "
            "fleet's owners do; then, for each loader, the payloads are decoded and applied "
            "one at a time onto a receiver holding other weights, against a dense native load "
            "through the same loader. Each phase runs in a fresh process and reports its peak "
            "resident memory above what it held before. The applied bits are checked against "
            "the dense load; a mismatch fails the run."
        ),
    )
    dense.add_argument("--size-gb", type=float, default=1.1, help="model size (default 1.1 GB)")
    dense.add_argument("--tp", type=_positive, default=2, help="training TP (default 2)")
    dense.add_argument(
        "--loaders",
        type=_loaders,
        default=["torch", "sharded-tp2"],
        help="subset of torch,sharded-tp2,vllm",
    )
    dense.add_argument("--chunk-mb", type=_positive, default=16, help="chunk size in MiB")
    dense.add_argument("--bucket-mb", type=_positive, default=64, help="bucket size in MiB")
    dense.add_argument("--threads", type=_positive, default=None, help="apply threads")
    dense.add_argument("--json", action="store_true", help="print one JSON object")

    proof = bsub.add_parser(
        "proof",
        help="cost and detection rate of the base-version proof and the fingerprint",
        description=(
            "Seconds per GB of resident weights of the sampled proof and the full fingerprint "
            "(owner side from shards, receiver side through the prewarm copy geometry), and "
            "the share of corrupted receivers each check detects (one flipped bit, another "
            "version, one refit behind, one wrong layer) over --trials seeded trials."
        ),
    )
    proof.add_argument("--size-mb", type=_positive, default=256, help="model size (default 256)")
    proof.add_argument("--samples", type=_positive, default=64, help="positions per tensor")
    proof.add_argument("--trials", type=_positive, default=100, help="trials per corruption")
    proof.add_argument("--repeats", type=_positive, default=2, help="cost runs (best)")
    proof.add_argument("--json", action="store_true", help="print one JSON object")

    fp8 = bsub.add_parser(
        "fp8",
        help="FP8 rollout refit: tiles touched, bytes and construction against a dense FP8 refit",
        description=(
            "A synthetic llama-family bf16 model quantized to its FP8 rollout checkpoint with "
            "each scheme of --blocks (N x N tiles, or 'channel'); each workload of --rates "
            "makes the next version. Reports the tiles its changed elements touch, the FP8 "
            "values and scales that change, payload bytes of the delta (only touched tiles "
            "re-quantized, changes sent as overwrites), of a dense FP8 refit and of the "
            "owners' adaptive choice (a region or tensor changed by at least dense_above, "
            "8%, goes whole), construction seconds of each (median of --repeats), and "
            "whether the delta gives the full quantization's bits (exact)."
        ),
    )
    fp8.add_argument("--size-mb", type=_positive, default=1024, help="model size (default 1024)")
    fp8.add_argument(
        "--rates", type=_workloads, default=[0.01, 0.03, 0.05], metavar="WORKLOADS",
        help=_WORKLOADS_HELP,
    )  # fmt: skip
    fp8.add_argument(
        "--blocks", type=_fp8_blocks, default=[128, None], metavar="N,...",
        help="scale schemes: tile sizes or 'channel' (default 128,channel)",
    )  # fmt: skip
    fp8.add_argument("--repeats", type=_positive, default=3, help="runs per point (median)")
    fp8.add_argument("--json", action="store_true", help="print one JSON object")

    rel = bsub.add_parser(
        "relay",
        help="relay-tree throughput on loopback against raw ZeroMQ, measured in one run",
        description=(
            "Streams --count payloads of --size bytes (a) from one DEALER to one ROUTER (raw "
            "ZeroMQ) and (b) from owners through a root and a balanced tree of relay nodes to "
            "receivers that take each delivery at once; reports bytes per second of both and "
            "their ratio (median of --repeats)."
        ),
    )
    rel.add_argument("--count", type=_positive, default=64, help="payloads (default 64)")
    rel.add_argument("--size-mb", type=float, default=4.0, help="payload size (default 4 MiB)")
    rel.add_argument("--nodes", type=_positive, default=3, help="relay nodes (default 3)")
    rel.add_argument("--fanout", type=_positive, default=2, help="tree fan-out (default 2)")
    rel.add_argument("--receivers", type=_positive, default=2, help="receivers (default 2)")
    rel.add_argument("--repeats", type=_positive, default=3, help="runs (median)")
    rel.add_argument(
        "--keys", action="store_true",
        help="also measure the tree with CURVE on every relay socket (a temporary key "
        "directory), right after the plain tree in each run",
    )  # fmt: skip
    rel.add_argument("--json", action="store_true", help="print one JSON object")

    refit = bsub.add_parser(
        "refit",
        help="end-to-end refit latency in a fleet of processes against full-checkpoint transfer",
        description=(
            "The paper's end-to-end comparison (sections 8.1, 8.5-8.7): a synthetic llama-family "
            "bf16 model of --size-gb in a fleet of processes (one owner process per training "
            "rank, one receiver process per rollout node) over each transport -- the relay "
            "tree, S3 against a SeaweedFS server started here, a local directory -- with every "
            "cross-boundary transfer behind an emulated link of --link-gbps per process and "
            "direction. Per transport: a warm-up refit, then --repeats refits at each rate, "
            "every receiver checked bit for bit; then the transport-only full-checkpoint "
            "reference over the same transport and link. Reports refit latency (the paper's "
            "timed window), reference, speedup, V_payload, V_cross, the construction and "
            "transport lower bounds and latency / max(bounds), plus where the time went. "
            "Exits non-zero if any receiver mismatched."
        ),
    )
    refit.add_argument("--size-gb", type=float, default=2.0, help="model size (default 2 GB)")
    refit.add_argument(
        "--rates", type=_floats, default=[0.01, 0.03, 0.05], help="element change rates"
    )
    refit.add_argument(
        "--transports", type=_transports, default=["relay", "s3", "directory"],
        help="subset of relay,s3,directory",
    )  # fmt: skip
    refit.add_argument("--repeats", type=_positive, default=1, help="timed refits per rate")
    refit.add_argument(
        "--link-gbps", type=float, default=1.0, help="emulated link rate (default 1 Gbit/s)"
    )
    refit.add_argument("--tp", type=_positive, default=4, help="training tensor parallelism")
    refit.add_argument("--dp", type=_positive, default=1, help="training data parallelism")
    refit.add_argument("--nodes", type=_positive, default=2, help="rollout nodes (default 2)")
    refit.add_argument("--serving-tp", type=_positive, default=2, help="serving TP (default 2)")
    refit.add_argument(
        "--build-threads",
        type=_positive,
        default=None,
        help="construction threads per owner process (default: the CPUs each may use)",
    )
    refit.add_argument(
        "--keys",
        action="store_true",
        help="give the fleets keys: CURVE on every socket, sealed payloads (docs/security.md)",
    )
    refit.add_argument(
        "--backend", type=_backends, default=["process"],
        help="process (default): the fleet as processes (dcr fleet's launcher); ray: the same "
        "fleet as actors on a local Ray cluster started here (head, a trainer node, one node "
        "per rollout node; needs Ray; on a shared machine run it under `unshare -n python -m "
        "dcr.ray.netns`); process,ray: both, one after the other, in one table",
    )  # fmt: skip
    refit.add_argument("--dir", default="out/bench-refit", help="fleet files, logs, events")
    refit.add_argument("--plot", default=None, help="write a PNG of the results here")
    refit.add_argument("--json", action="store_true", help="print one JSON object")

    project = bsub.add_parser(
        "project",
        help="refit latency and speedup projected to the paper's testbed (30B-1T)",
        description=(
            "Projects refit latency and speedup for the checkpoints of the paper's Table C.1 "
            "(30B-1T) on its testbed (8 training and 8 rollout nodes, 5 Gbit/s per node across "
            "clusters) at 3% and 5%, from what `dcr bench refit --json` measured on this "
            "machine (--from FILE, or a small run made here), and prints them beside the "
            "paper's reported figures (Table 4, Fig. 10) with every assumption."
        ),
    )
    project.add_argument("--from", dest="source", default=None, help="dcr bench refit JSON")
    project.add_argument(
        "--size-gb", type=float, default=0.5, help="without --from: model of the run made here"
    )
    project.add_argument("--json", action="store_true", help="print one JSON object")


def _bench_codec(args: argparse.Namespace) -> int:
    from dcr.bench.codec import (
        format_codec_table,
        format_floor_table,
        run_codec_bench,
        run_floor_bench,
    )

    if args.floor:
        floor = run_floor_bench(n=args.n, level=args.level, repeats=args.repeats)
        print(json.dumps(floor) if args.json else format_floor_table(floor))
        return 0
    result = run_codec_bench(n=args.n, amplitudes=tuple(args.amplitudes), level=args.level)
    print(json.dumps(result) if args.json else format_codec_table(result))
    return 0


def _bench_construct(args: argparse.Namespace) -> int:
    from dcr.bench.construct import format_construct_table, run_construct_bench
    from dcr.tensors.records import Encoding

    result = run_construct_bench(
        size_bytes=int(args.size_gb * 1e9),
        rates=args.rates,
        modes=args.modes,
        repeats=args.repeats,
        tp=args.tp,
        relative_encoding=Encoding.ULP if args.relative == "ulp" else Encoding.XOR,
        chunk_bytes=args.chunk_mb << 20,
        bucket_bytes=args.bucket_mb << 20,
        dense_above=args.dense_above,
        log=_err,
    )
    print(json.dumps(result) if args.json else format_construct_table(result))
    return 0


def _bench_apply(args: argparse.Namespace) -> int:
    from dcr.bench.apply import format_apply_table, run_apply_bench
    from dcr.delta.build import DENSE_ABOVE

    result = run_apply_bench(
        size_bytes=int(args.size_gb * 1e9),
        rates=args.rates,
        loaders=args.loaders,
        repeats=args.repeats,
        threads=args.threads,
        dense_above=DENSE_ABOVE if args.dense_above is None else args.dense_above,
        log=_err,
    )
    print(json.dumps(result) if args.json else format_apply_table(result))
    return 0


def _bench_dense(args: argparse.Namespace) -> int:
    from dcr.bench.dense import format_dense_table, run_dense_bench

    result = run_dense_bench(
        size_bytes=int(args.size_gb * 1e9),
        tp=args.tp,
        chunk_bytes=args.chunk_mb << 20,
        bucket_bytes=args.bucket_mb << 20,
        loaders=args.loaders,
        threads=args.threads,
        log=_err,
    )
    print(json.dumps(result) if args.json else format_dense_table(result))
    return 0


def _bench_proof(args: argparse.Namespace) -> int:
    from dcr.bench.proof import run_proof_bench

    result = run_proof_bench(
        size_mb=args.size_mb, samples=args.samples, trials=args.trials, repeats=args.repeats
    )
    if args.json:
        print(json.dumps(result))
        return 0
    cost = result["cost"]
    print(f"resident weights {cost['resident_gb']:.2f} GB; seconds per GB (owner / receiver)")
    for label in ("sample", "fingerprint"):
        print(
            f"  {label:<12} {cost[f'{label}_owner_s_per_gb']:8.4f} / "
            f"{cost[f'{label}_receiver_s_per_gb']:8.4f}"
        )
    print(f"detected over {result['trials']} trials (sample proof / fingerprint)")
    for kind, rates in result["detection"].items():
        print(f"  {kind:<20} {rates['sample']:6.0%} / {rates['fingerprint']:6.0%}")
    return 0


def _bench_fp8(args: argparse.Namespace) -> int:
    from dcr.bench.fp8 import format_fp8_table, run_fp8_bench

    result = run_fp8_bench(
        size_bytes=args.size_mb << 20, rates=args.rates, blocks=args.blocks,
        repeats=args.repeats, progress=lambda m: print(m, file=sys.stderr, flush=True),
    )  # fmt: skip
    print(json.dumps(result) if args.json else format_fp8_table(result))
    return 0


def _bench_relay(args: argparse.Namespace) -> int:
    import statistics

    import anyio

    from dcr.bench.relay import relay_throughput

    runs = [
        anyio.run(
            lambda: relay_throughput(
                count=args.count,
                size=int(args.size_mb * (1 << 20)),
                nodes=args.nodes,
                fanout=args.fanout,
                receivers=args.receivers,
                keys=args.keys,
            ),
            backend="asyncio",
        )
        for _ in range(args.repeats)
    ]
    keys = runs[0].keys()
    result = {k: statistics.median(r[k] for r in runs) for k in keys}
    result["repeats"] = args.repeats
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"raw ZeroMQ {result['raw_bytes_per_s'] / 1e9:.2f} GB/s | relay tree "
            f"{result['relay_bytes_per_s'] / 1e9:.2f} GB/s per receiver | ratio "
            f"{result['ratio']:.3f} | {result['hops']:.0f} link transfers per payload in one "
            f"thread: {result['link_ratio']:.2f} of raw (median of {args.repeats})"
        )
        if args.keys:
            print(
                f"with CURVE on every relay socket: {result['keyed_bytes_per_s'] / 1e9:.2f} GB/s "
                f"per receiver, {result['keyed_ratio']:.2f} of the plain tree (median of "
                f"{args.repeats})"
            )
    return 0


def _bench_refit(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcr.bench.refit import BenchLayout, format_refit_table, plot_refit, run_refit_bench

    with stdout_to_stderr():  # (Ray's driver prints its raylets' messages to stdout)
        result = run_refit_bench(
            size_bytes=args.size_gb * 1e9,
            rates=args.rates,
            transports=args.transports,
            repeats=args.repeats,
            link_gbps=args.link_gbps,
            layout=BenchLayout(
                tp=args.tp,
                dp=args.dp,
                nodes=args.nodes,
                serving_tp=args.serving_tp,
                build_threads=args.build_threads or 0,
            ),
            directory=Path(args.dir),
            log=_err,
            keys=args.keys,
            backends=args.backend,
        )
    if args.plot:
        plot_refit(result, Path(args.plot))
    print(json.dumps(result) if args.json else format_refit_table(result))
    return 0 if result["bit_exact"] else 1


def _bench_project(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcr.bench.project import format_projection, measure_for_projection, project

    if args.source:
        measured = json.loads(Path(args.source).read_text())
    else:
        measured = measure_for_projection(size_bytes=args.size_gb * 1e9, log=_err)
    result = project(measured)
    print(json.dumps(result) if args.json else format_projection(result))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return {
        "apply": _bench_apply,
        "codec": _bench_codec,
        "construct": _bench_construct,
        "dense": _bench_dense,
        "fp8": _bench_fp8,
        "project": _bench_project,
        "proof": _bench_proof,
        "refit": _bench_refit,
        "relay": _bench_relay,
    }[args.bench](args)
