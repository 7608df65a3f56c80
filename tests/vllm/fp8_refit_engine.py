"""An FP8 engine refitted in place: what a fresh engine on the next FP8 export must equal.

Run as a script (one process, TP 1; ``python fp8_refit_engine.py --out DIR --prompts FILE
--max-tokens N --port P --block channel BF16_V0 BF16_V1 FP8_V0``): a vLLM engine is started on
``FP8_V0`` (``dcr fp8 export`` of ``BF16_V0``) exactly as the reference engines of
:mod:`reference_engine` are; inside its worker a receiver on vLLM's native loader takes the FP8
refit of ``BF16_V0 -> BF16_V1`` that owners send (only the re-quantized tiles that changed,
:class:`~dcr.delta.fp8.Fp8Rollout`); then its parameters and the fixed prompts' greedy
generations are written as ``DIR/refit-r0.npz`` and ``DIR/refit.json``.  ``--plain no``
starts the engine without the plain-weights load format and writes what a receiver would find
repacked (:func:`~dcr.adapters.loaders.vllm.find_repacked`) to ``DIR/repacked.json`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))


def _items(bf16_v0: str, bf16_v1: str, block: int | None) -> list[Any]:
    from dcr.delta.fp8 import Fp8Rollout
    from dcr.models.hf import read_checkpoint
    from dcr.tensors.fp8 import Fp8Scheme, quantized_names
    from dcr.testing.fp8 import refit_items

    v0, v1 = read_checkpoint(bf16_v0), read_checkpoint(bf16_v1)
    names = quantized_names({n: tuple(t.shape) for n, t in v0.items()})
    return refit_items(v0, v1, Fp8Rollout(Fp8Scheme(block), {n: v0[n] for n in names}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--port", required=True)
    p.add_argument("--block", default="channel")
    p.add_argument("--plain", default="yes")
    p.add_argument("checkpoints", nargs=3)
    args = p.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", MASTER_PORT=args.port, RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")  # fmt: skip
    import numpy as np
    import reference_engine

    import dcr.integrations.vllm.plain  # noqa: F401  (the load format)
    from dcr.catalog import read_catalog

    bf16_v0, bf16_v1, fp8_v0 = args.checkpoints
    block = None if args.block == "channel" else int(args.block)
    items = _items(bf16_v0, bf16_v1, block)
    catalog = read_catalog(fp8_v0)
    out = Path(args.out)

    def refit(llm: Any) -> None:
        def apply(model: Any) -> None:
            from dcr.adapters.loaders.vllm import VllmLoader
            from dcr.apply.applier import Applier

            loader = VllmLoader(model)
            loader.check_ready()
            receiver = Applier(loader, catalog)
            receiver.prewarm()
            receiver.apply_items(items, attempt=1)

        llm.apply_model(apply)

    if args.plain != "yes":  # the engine's own weight processing: what the receiver finds

        def inspect(llm: Any) -> None:
            from dcr.adapters.loaders.vllm import find_repacked

            (found,) = llm.apply_model(find_repacked)
            (out / "repacked.json").write_text(json.dumps(found))

        reference_engine._one(fp8_v0, 1, [], 1, before=inspect, load_format="auto")
        return
    prompts = json.loads(Path(args.prompts).read_text())
    params, outputs = reference_engine._one(fp8_v0, 1, prompts, args.max_tokens, before=refit)
    np.savez(out / "refit-r0.npz", **params)
    (out / "refit.json").write_text(json.dumps(outputs))


if __name__ == "__main__":
    main()
