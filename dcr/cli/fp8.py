"""``dcr fp8 export``: the FP8 rollout checkpoint of a BF16 checkpoint directory, written by
the quantizer every FP8 refit uses (``docs/fp8.md``), so that an engine started on the export
holds the bits a refit to that version must give."""

from __future__ import annotations

import argparse
import json
import sys

from dcr.cli.arguments import _err, _fp8_block, _positive


def add_fp8_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fp8 = sub.add_parser(
        "fp8",
        help="FP8 rollout checkpoints of a BF16 checkpoint",
        description="FP8 rollout checkpoints: float8_e4m3fn weights with float32 scales.",
    )
    fsub = fp8.add_subparsers(dest="fp8_command", required=True)
    export = fsub.add_parser(
        "export",
        help="write the FP8 rollout checkpoint of a BF16 checkpoint directory",
        description=(
            "Quantizes every q/k/v/o and gate/up/down projection weight of SOURCE (a Hugging "
            "Face checkpoint directory of BF16 weights) to float8_e4m3fn with float32 scales "
            "and writes DESTINATION: config.json with the quantization_config vLLM reads "
            "(its 'fp8' method with weight_block_size for block scales; compressed-tensors "
            "with channel weights for --block channel) and the tensors in safetensors. "
            "Norms, embeddings, the LM head and MoE routers stay BF16. The quantizer is the "
            "one FP8 refits use: a fresh load of the export is the reference of a refit."
        ),
    )
    export.add_argument("source", help="BF16 checkpoint directory")
    export.add_argument("destination", help="directory to write (its checkpoint is replaced)")
    export.add_argument("--block", type=_fp8_block, default=128, metavar="N|channel",
                        help="scale tiles of N x N elements (default 128), or 'channel' for "
                        "one scale per output row")  # fmt: skip
    export.add_argument("--shard-mb", type=_positive, default=None,
                        help="write files of at most this many MB with an index")  # fmt: skip
    export.add_argument("--json", action="store_true", help="print one JSON object")


def run_fp8_command(args: argparse.Namespace) -> int:
    from dcr.errors import DcrError
    from dcr.models.fp8 import export_checkpoint
    from dcr.tensors.fp8 import Fp8Scheme

    def progress(done: int, total: int) -> None:
        if done == total or done % 50 == 0:
            print(f"quantized {done}/{total} tensors", file=sys.stderr, flush=True)

    try:
        summary = export_checkpoint(
            args.source,
            args.destination,
            Fp8Scheme(args.block),
            shard_bytes=None if args.shard_mb is None else args.shard_mb << 20,
            progress=progress,
        )
    except DcrError as exc:
        _err(f"dcr fp8 export: {type(exc).__name__}: {exc}")
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        mb_in, mb_out = summary["bytes_in"] / 1e6, summary["bytes_out"] / 1e6
        print(f"{args.destination}: {summary['quantized']} weights quantized "
              f"({summary['scheme']} scales), {summary['kept']} tensors kept; "
              f"{mb_in:.1f} MB -> {mb_out:.1f} MB")  # fmt: skip
    return 0
