"""Engines started fresh on checkpoints: what a refitted engine must match bit for bit.

Run as a script, once per tensor-parallel rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` set; ``python reference_engine.py --out DIR --prompts FILE --ports P0,P1,..
CK0 CK1 ...``): for each checkpoint, a vLLM engine is started fresh on it (the same model
class, plain-weights load format, dcr worker extension and tensor parallelism as the engine
under test; vLLM's external-launcher executor, so each of these processes is one worker
and the next engine starts without importing vLLM again), its parameters and buffers are
read through ``collective_rpc``, and each prompt of the fixed set is generated greedily, one
request at a time, with the log probability of every sampled token.  ``DIR/ref-<i>-r<rank>.npz``
holds the rank's parameters (name -> integer view of the stored bits) and ``DIR/ref-<i>.json``
the generations (rank 0).  The engine is shut down before the next one starts; engine ``i``
forms its process group on port ``P<i>``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _one(
    checkpoint: str,
    tp: int,
    prompts: list[list[int]],
    max_tokens: int,
    before: Callable[[Any], None] | None = None,
    load_format: str | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One fresh engine's parameters and generations (``before(llm)`` runs first: a refit
    of the engine in place, for an engine under test; ``load_format``: the plain-weights one
    unless given)."""
    from vllm import LLM, SamplingParams

    from dcr.integrations.vllm import EXTENSION, PLAIN_WEIGHTS
    from dcr.integrations.vllm.engine import parameter_bits

    llm = LLM(
        model=checkpoint,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        load_format=load_format or PLAIN_WEIGHTS,
        worker_extension_cls=EXTENSION,
        distributed_executor_backend="external_launcher",
    )
    try:
        if before is not None:
            before(llm)
        (raw,) = llm.collective_rpc("dcr_parameters")
        params = parameter_bits(raw)
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False
        )
        outputs = []
        for prompt in prompts:
            out = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
            completion = out.outputs[0]
            outputs.append(
                {
                    "token_ids": list(completion.token_ids),
                    "logprobs": [
                        float(step[token].logprob)
                        for step, token in zip(
                            completion.logprobs, completion.token_ids, strict=True
                        )
                    ],
                }
            )
        return params, outputs
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ports", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("checkpoints", nargs="+")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import numpy as np

    import dcr.integrations.vllm.plain  # noqa: F401  (the load format)

    prompts = json.loads(Path(args.prompts).read_text())
    out = Path(args.out)
    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ports = args.ports.split(",")
    for i, checkpoint in enumerate(args.checkpoints):
        os.environ["MASTER_PORT"] = ports[i]
        params, outputs = _one(checkpoint, tp, prompts, args.max_tokens)
        np.savez(out / f"ref-{i}-r{rank}.npz", **params)
        if rank == 0:
            (out / f"ref-{i}.json").write_text(json.dumps(outputs))


if __name__ == "__main__":
    main()
