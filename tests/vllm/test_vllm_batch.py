"""Reproducible batches and dense reloads on running vLLM engines (the RL loop's two runs).

An RL run that refits its rollout engine by deltas and a run that reloads a full checkpoint
after every step must sample the same tokens at every step.  This module checks the engine
side of that on CPU engines (``python -m dcr.integrations.vllm``, plain-weights load format,
``--no-prefix-cache --no-chunked-prefill``, one compute thread per worker):

* a seeded batch (``POST /generate_batch``, GRPO-like: groups of samples per prompt, one
  prompt longer than a KV-cache block) gives the same token ids and log-probability bits
  twice in one engine, at TP 1 and TP 2, and in two engine processes on one checkpoint;
* a batch that arrives while another request is decoding still runs as on an idle engine
  (its requests enter the scheduler together, once the engine drained), while the same
  requests run in other company give other bits -- on CPU a bf16 GEMM row depends on how many
  rows its step computes, so batch composition changes numerics;
* ``POST /dcr/load`` of checkpoint v1 into an engine started on v0 leaves exactly the
  parameter bits, the digest (``GET /dcr/digest``) and the batch tokens of an engine started
  fresh on v1, and requests report version 0 before and 1 after;
* malformed batches, malformed or mismatched checkpoints and an engine whose weights the CPU
  backend repacked are refused with 4xx answers that say why, the weights untouched.

The model is a tiny Qwen3 (2 layers) with hidden size 512: large enough that the CPU's bf16
GEMM kernels block differently for different row counts.  An engine takes 40-100 s to start
on a 2-core machine, so the module starts four (two at TP 1, one at TP 2, one with vLLM's
defaults) and checks everything it can on them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch
from engine_helpers import EngineServer, LongRequest, bit_mismatches, same_floats

from dcr.catalog import read_catalog
from dcr.errors import CheckpointError, ConfigError
from dcr.integrations.vllm.checkpoint import PARTIAL_LOAD, load_checkpoint, weights_digest
from dcr.integrations.vllm.engine import gate_of
from dcr.integrations.vllm.gate import EngineGate
from dcr.integrations.vllm.generation import MAX_SEED, BatchRequest, check_batch, generate_batch
from dcr.integrations.vllm.join import error_to_wire
from dcr.integrations.vllm.versions import UNCONFIRMED, dense_record, label_of
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.hf import write_checkpoint

pytestmark = pytest.mark.vllm

CONFIG = tiny_config(
    "qwen3",
    hidden_size=512,
    intermediate_size=1536,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=1024,
)
VOCAB = int(CONFIG["vocab_size"])
REPRODUCIBLE = ("--no-prefix-cache", "--no-chunked-prefill")
"""Engine options of the RL loop's engines."""
COMPARED = (*REPRODUCIBLE, "--expose-parameters")
"""Those of engines whose parameter bits a test reads (``GET /dcr/parameters``)."""


# -- checkpoints and batches ----------------------------------------------------------------


def _step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An optimizer step's worth of change: about 3% of each tensor's elements move."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=gen) < 0.03
        noise = (0.01 * torch.randn(t.shape, generator=gen)).to(t.dtype)
        out[name] = torch.where(mask, t + noise, t)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """v0 and v1 (one step later) of the model, and checkpoints an engine must refuse."""
    root = tmp_path_factory.mktemp("checkpoints")
    v0 = random_state_dict(CONFIG, "qwen3", seed=7, std=0.1)
    v1 = _step(v0, seed=1)
    paths = {
        "v0": write_checkpoint(root / "v0", CONFIG, "qwen3", v0),
        "v1": write_checkpoint(root / "v1", CONFIG, "qwen3", v1),
    }
    other = tiny_config("qwen3", hidden_size=256, intermediate_size=768,
                        num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    paths["other-shapes"] = write_checkpoint(
        root / "other-shapes", other, "qwen3", random_state_dict(other, "qwen3", seed=3)
    )
    # The tensors of v1 under another model type.
    retyped = root / "other-type"
    retyped.mkdir()
    for f in paths["v1"].iterdir():
        (retyped / f.name).write_bytes(f.read_bytes())
    config = json.loads((retyped / "config.json").read_text())
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    (retyped / "config.json").write_text(json.dumps(config))
    paths["other-type"] = retyped
    # v1 with its tensor data cut short.
    truncated = root / "truncated"
    truncated.mkdir()
    for f in paths["v1"].iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors"
                                         else data)  # fmt: skip
    paths["truncated"] = truncated
    (root / "empty").mkdir()
    paths["empty"] = root / "empty"
    return paths


def batch() -> list[dict[str, Any]]:
    """A GRPO-like rollout batch: three seeded samples of each of four prompts (the first
    longer than a KV-cache block of 128 tokens), one with top-p, and one greedy request."""
    rng = random.Random(21)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (200, 9, 31, 4)]
    out = []
    for p, prompt in enumerate(prompts):
        for k in range(3):
            out.append({"prompt_token_ids": prompt, "max_tokens": 24, "temperature": 1.0,
                        "top_p": 0.9 if k == 2 else 1.0, "seed": 1000 + 10 * p + k,
                        "ignore_eos": True})  # fmt: skip
    out.append({"prompt_token_ids": prompts[1], "max_tokens": 24, "temperature": 0.0, "seed": 0,
                "ignore_eos": True})  # fmt: skip
    return out


def _differences(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> list[int]:
    """Indices of requests whose token ids or log-probability bits differ."""
    assert len(a) == len(b)
    return [
        i
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        if x["token_ids"] != y["token_ids"] or not same_floats(x["logprobs"], y["logprobs"])
    ]


def _versions(results: Sequence[dict[str, Any]]) -> set[tuple[int | None, str | None]]:
    return {(r["version"], r["candidate"]) for r in results}


def _start(directory: Path, model: Path, tp: int, version: int, name: str,
           options: Sequence[str] = REPRODUCIBLE, plain: bool = True) -> EngineServer:  # fmt: skip
    return EngineServer.start(directory, model=model, tp=tp, checkpoint_version=version,
                              name=name, options=options, plain_weights=plain)  # fmt: skip


def _ready(engines: Sequence[EngineServer], since: float) -> list[float]:
    """Wait for every engine; the seconds from ``since`` (``time.time()`` before they were
    started) until each one served (its ready file was written)."""
    for e in engines:
        e.wait_ready(timeout_s=480)
    return [e.ready_file.stat().st_mtime - since for e in engines]


def _timed_batch(engine: EngineServer, requests: list[dict[str, Any]]) -> tuple[list[Any], float]:
    t0 = time.monotonic()
    results = engine.generate_batch(requests)
    return results, time.monotonic() - t0


def _bad(engine: EngineServer, path: str, body: Any, status: int, words: str) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = engine.request(path, data)
    assert got == status and words in answer.get("error", ""), (body, got, answer)


# -- engines --------------------------------------------------------------------------------


def test_tp1_batches_are_reproducible_and_a_dense_load_equals_a_fresh_engine(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Engine ``a`` on v0 samples the same bits twice and while busy; ``a`` then loads v1 and
    equals ``b``, another process started fresh on v1, in its digest and its batch bits;
    refusals leave ``a`` as it was.  A seeded batch over one step's token budget runs whole
    on ``b``."""
    requests = batch()
    t0 = time.time()
    a = _start(tmp_path, checkpoints["v0"], 1, 0, "a", options=COMPARED)
    b = _start(tmp_path, checkpoints["v1"], 1, 1, "b")
    try:
        starts = _ready([a, b], t0)
        # Every weight's bytes are served only to an engine started to expose them.
        assert b.request("/dcr/parameters")[0] == 404
        # One engine twice: the same bits.
        first, first_s = _timed_batch(a, requests)
        again, again_s = _timed_batch(a, requests)
        assert _differences(first, again) == []
        assert _versions(first) == {(0, "dense-0")}
        assert all(len(r["token_ids"]) == 24 and r["switches"] == [] for r in first)

        # A batch arriving while another request decodes waits until the engine drained,
        # then runs alone: the same bits as on an idle engine.
        long = LongRequest(a, "long", [5, 6, 7], 400)

        async def busy() -> list[dict[str, Any]]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(long.run)
                await long.wait_tokens(1)
                results = await anyio.to_thread.run_sync(a.generate_batch, requests)
            return results

        assert _differences(anyio.run(busy, backend="asyncio"), first) == []
        assert long.result is not None and len(long.result["token_ids"]) == 400

        # Dense load of v1 into the engine started on v0, against the engine started on v1:
        # two processes on one checkpoint, the same bits (the digest is SHA-256 over every
        # stored byte).
        v0_parameters, v0_digest = a.parameters(), a.digest()
        loaded = a.load(checkpoints["v1"], 1)
        assert (loaded["version"], loaded["candidate"]) == (1, "dense-1")
        assert loaded["tensors"] == len(read_catalog(checkpoints["v1"]))
        v1_digest = a.digest()
        assert v1_digest == b.digest() != v0_digest
        assert bit_mismatches(a.parameters(), v0_parameters) != []
        on_v1, _ = _timed_batch(a, requests)
        fresh_v1, _ = _timed_batch(b, requests)
        assert _differences(on_v1, fresh_v1) == []
        assert _versions(on_v1) == _versions(fresh_v1) == {(1, "dense-1")}
        assert _differences(on_v1, first), "v1 sampled exactly what v0 did"
        state = a.state()
        assert state["record"] == label_of(dense_record(1)) and not state["closed"]
        assert [c["version"] for c in state["cycles"]] == [1]

        # Refusals leave the engine serving v1, bit for bit.
        _refusals(a, checkpoints)
        assert a.digest() == v1_digest
        assert _differences(a.generate_batch(requests), on_v1) == []
        assert a.state()["record"] == label_of(dense_record(1))

        # Without chunked prefill a seeded batch larger than one step's default token budget
        # runs (vLLM 0.32 on CPU crashes on a seeded request whose prefill is chunked).  Why a
        # batch's requests must enter the scheduler together is printed, as this CPU shows it:
        # how many of the same requests, each run alone, sample other bits than in their batch
        # (CPU bf16 matmuls may give a row other bits in another batch; some CPUs' kernels do
        # not).
        alone = [b.generate_batch([r])[0] for r in requests]
        differ = _differences(fresh_v1, alone)
        over = [{**requests[0], "prompt_token_ids": [1] * 700, "seed": s} for s in range(3)]
        assert [len(r["token_ids"]) for r in b.generate_batch(over)] == [24] * 3
        print(f"\nTP1: engines served after {starts[0]:.1f} s and {starts[1]:.1f} s (started "
              f"together); batch of {len(requests)}: first {first_s:.2f} s, then "
              f"{again_s:.2f} s; dense load {loaded['seconds']:.3f} s (workers "
              f"{loaded['load_seconds']:.3f} s); {len(differ)} of {len(requests)} requests "
              f"sampled other bits alone than in their batch: {differ}")  # fmt: skip
    finally:
        a.stop()
        b.stop()


def _refusals(engine: EngineServer, checkpoints: dict[str, Path]) -> None:
    good = batch()[0]
    bad_requests: list[tuple[Any, str]] = [
        (b"not json", "Expecting value"),
        ([good], "JSON object"),
        ({}, "non-empty list"),
        ({"requests": []}, "non-empty list"),
        ({"requests": [good], "model": "x"}, "unknown fields ['model']"),
        ({"requests": [good] * 1025}, "at most 1024 requests"),
        ({"requests": [good, 7]}, "request 1: a request must be a JSON object"),
        ({"requests": [{**good, "logprobs": 5}]}, "unknown request fields ['logprobs']"),
        ({"requests": [{k: v for k, v in good.items() if k != "seed"}]}, "missing"),
        ({"requests": [{**good, "prompt_token_ids": []}]}, "non-empty list of token ids"),
        ({"requests": [{**good, "prompt_token_ids": [1, -2]}]}, "non-negative integers"),
        ({"requests": [{**good, "prompt_token_ids": [1, 2.0]}]}, "non-negative integers"),
        ({"requests": [{**good, "prompt_token_ids": [True]}]}, "non-negative integers"),
        ({"requests": [{**good, "prompt_token_ids": [1, VOCAB]}]}, "outside the model's vocab"),
        ({"requests": [{**good, "max_tokens": 0}]}, "max_tokens must be a positive integer"),
        ({"requests": [{**good, "max_tokens": "3"}]}, "max_tokens must be a positive integer"),
        ({"requests": [{**good, "max_tokens": 1000}]}, "exceed the model's context of 1024"),
        ({"requests": [{**good, "temperature": -1}]}, "temperature must be >= 0"),
        ({"requests": [{**good, "temperature": "1"}]}, "temperature must be a finite number"),
        (b'{"requests": [{"prompt_token_ids": [1], "max_tokens": 1, "temperature": NaN, '
         b'"seed": 1}]}', "temperature must be a finite number"),
        ({"requests": [{**good, "top_p": 0}]}, "top_p must lie in (0, 1]"),
        ({"requests": [{**good, "top_p": 1.5}]}, "top_p must lie in (0, 1]"),
        ({"requests": [{**good, "seed": -1}]}, "seed must be an integer"),
        ({"requests": [{**good, "seed": 2**63}]}, "seed must be an integer"),
        ({"requests": [{**good, "seed": 1.0}]}, "seed must be an integer"),
        ({"requests": [{**good, "seed": True}]}, "seed must be an integer"),
        ({"requests": [{**good, "ignore_eos": "yes"}]}, "ignore_eos must be true or false"),
    ]  # fmt: skip
    for body, words in bad_requests:
        _bad(engine, "/generate_batch", body, 400, words)
    got, _ = engine.request("/generate_batch", b" " * (17 << 20))
    assert got == 413
    bad_loads: list[tuple[Any, str]] = [
        ({"checkpoint": str(checkpoints["v1"])}, "version must be a non-negative integer"),
        ({"checkpoint": str(checkpoints["v1"]), "version": -1}, "non-negative integer"),
        ({"checkpoint": str(checkpoints["v1"]), "version": True}, "non-negative integer"),
        ({"checkpoint": "", "version": 2}, "checkpoint must be a non-empty string"),
        ({"checkpoint": "x", "version": 2, "step": 3}, "unknown fields ['step']"),
        ({"checkpoint": str(checkpoints["v1"] / "missing"), "version": 2},
         "no such checkpoint directory"),
        ({"checkpoint": str(checkpoints["empty"]), "version": 2}, "no *.safetensors file"),
        ({"checkpoint": str(checkpoints["other-shapes"]), "version": 2},
         "differs from the catalog of the engine's checkpoint"),
        ({"checkpoint": str(checkpoints["other-type"]), "version": 2},
         "model_type 'llama' differs from the engine's model ('qwen3')"),
        ({"checkpoint": str(checkpoints["truncated"]), "version": 2}, "model.safetensors"),
    ]  # fmt: skip
    for body, words in bad_loads:
        _bad(engine, "/dcr/load", body, 400, words)


def test_tp2_batches_are_reproducible_and_dense_loads_are_exact(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A TP=2 engine on v0 samples the same bits twice; it loads v1, then v0 again, and then
    holds every parameter bit it started with, its digest and its batch.  (Two TP=2 processes
    on one checkpoint sampling the same bits: the serving engine's fresh engines.)"""
    requests = batch()
    t0 = time.time()
    d = _start(tmp_path, checkpoints["v0"], 2, 0, "d", options=COMPARED)
    try:
        (start,) = _ready([d], t0)
        first, first_s = _timed_batch(d, requests)
        assert _differences(d.generate_batch(requests), first) == []
        assert _versions(first) == {(0, "dense-0")}
        started, digest = d.parameters(), d.digest()
        assert d.request("/dcr/digest")[1]["ranks"] == 2
        assert {name.split("/")[0] for name in started} == {"r0", "r1"}

        assert d.load(checkpoints["v1"], 1)["version"] == 1
        on_v1 = d.generate_batch(requests)
        assert _versions(on_v1) == {(1, "dense-1")}
        assert d.digest() != digest and _differences(on_v1, first)
        back = d.load(checkpoints["v0"], 0)
        assert (back["version"], back["candidate"]) == (0, "dense-0")
        assert bit_mismatches(d.parameters(), started) == []
        assert d.digest() == digest
        again = d.generate_batch(requests)
        assert _differences(again, first) == []
        assert _versions(again) == {(0, "dense-0")}
        print(f"\nTP2: engine served after {start:.1f} s; batch of {len(requests)}: first "
              f"{first_s:.2f} s; dense load {back['seconds']:.3f} s")  # fmt: skip
    finally:
        d.stop()


def test_an_engine_refuses_loads_into_repacked_weights_and_batches_it_would_split(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """An engine started without the plain-weights load format and with vLLM's defaults
    (prefix cache, chunked prefill) refuses a seeded batch that could not prefill in one step
    (400) and serves on.  Where the CPU backend repacked its weights (``/dcr/state`` names the
    modules) it refuses a dense load (409) and keeps its bits; where this CPU left them plain
    (vLLM falls back to ``F.linear`` when it cannot build its packed GEMM kernels) the load
    succeeds and the engine serves the new version."""
    requests = batch()
    engine = _start(tmp_path, checkpoints["v0"], 1, 0, "packed", options=(), plain=False)
    try:
        _ready([engine], time.time())
        digest = engine.digest()
        repacked = engine.state()["repacked"]
        assert len(repacked) == 1, repacked
        body = {"checkpoint": str(checkpoints["v1"]), "version": 1}
        if repacked[0]:
            _bad(engine, "/dcr/load", body, 409, "check=repacked")
            assert engine.digest() == digest
            version = (0, "dense-0")
        else:
            status, answer = engine.request("/dcr/load", json.dumps(body).encode())
            assert status == 200 and answer["version"] == 1, answer
            assert engine.digest() != digest
            version = (1, "dense-1")
        over = [{**requests[0], "prompt_token_ids": [1] * 700, "seed": s} for s in range(3)]
        _bad(engine, "/generate_batch", {"requests": over}, 400, "--no-chunked-prefill")
        assert _versions(engine.generate_batch(requests)) == {version}
    finally:
        engine.stop()
    print(f"\nrepacked by this CPU's backend: {sorted(repacked[0]) or 'nothing'}")


# -- engine-side logic on a stand-in engine (no vLLM engine started) -----------------------


class _Queue:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, WeightVersionSpan

        self.request_id = f"{request_id}-internal"
        completion = CompletionOutput(
            index=0, text="", token_ids=tokens, cumulative_logprob=None,
            logprobs=[{t: Logprob(logprob=-0.5 * t)} for t in tokens], finish_reason="length",
            weight_versions=[WeightVersionSpan("dcr:3:g1", 0, len(tokens))],
        )  # fmt: skip
        self.outputs = [SimpleNamespace(finished=False, outputs=[completion]),
                        SimpleNamespace(finished=True, outputs=[completion])]  # fmt: skip
        self.closed = False

    def get_nowait(self) -> Any:
        return self.outputs.pop(0) if len(self.outputs) > 1 else None

    async def get(self) -> Any:
        await anyio.sleep(0)
        return self.outputs.pop(0)

    def close(self) -> None:
        self.closed = True


class _Engine:
    """What generate_batch, the gate and load_checkpoint use of an ``AsyncLLM``, recorded."""

    def __init__(self, *, chunked: bool = False, ranks: int = 1) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.paused = False
        self.fail_add_at: int | None = None
        self.rpc: dict[str, list[dict[str, Any]]] = {}
        self.queues: list[_Queue] = []
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB, max_model_len=1024),
            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked,
                                             max_num_batched_tokens=2048,
                                             long_prefill_token_threshold=0),
            device_config=SimpleNamespace(device_type="cpu"),
            parallel_config=SimpleNamespace(world_size=ranks),
        )  # fmt: skip

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> None:
        self.calls.append(("reset",))

    async def update_weight_version(self, label: str) -> None:
        self.calls.append(("label", label))

    async def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> _Queue:
        if self.fail_add_at == len(self.queues):
            raise ValueError("refused by the engine")
        self.calls.append(("add", request_id, self.paused, params.seed))
        queue = _Queue(request_id, [len(self.queues) + 1, 7])
        self.queues.append(queue)
        return queue

    async def abort(self, request_ids: list[str], internal: bool = False) -> None:
        self.calls.append(("abort", tuple(request_ids), internal))

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append(("rpc", method))
        return self.rpc[method]


def _requests(n: int) -> list[BatchRequest]:
    return [BatchRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, temperature=1.0, seed=i)
            for i in range(n)]  # fmt: skip


def test_a_batch_is_added_while_the_engine_is_paused_and_returned_in_order() -> None:
    engine = _Engine()
    out = anyio.run(generate_batch, engine, _requests(3))
    kinds = [c[0] for c in engine.calls]
    assert kinds == ["pause", "add", "add", "add", "resume"]
    assert engine.calls[0] == ("pause", "wait")
    assert all(c[2] for c in engine.calls if c[0] == "add")  # every add while paused
    assert [c[3] for c in engine.calls if c[0] == "add"] == [0, 1, 2]  # seeds, in order
    assert [g.token_ids for g in out] == [(1, 7), (2, 7), (3, 7)]
    assert out[1].logprobs == (-1.0, -3.5) and out[0].record is not None
    assert out[0].record.version == 3 and all(q.closed for q in engine.queues)
    assert anyio.run(generate_batch, engine, []) == []


def test_a_batch_waits_behind_a_closed_gate_and_a_failed_add_aborts_the_rest() -> None:
    engine = _Engine()
    gate = EngineGate(engine, 1)  # receivers: ranks start closed

    async def closed() -> None:
        await gate.close(0)
        engine.calls.clear()
        await generate_batch(engine, _requests(2), gate=gate)

    anyio.run(closed)
    assert [c[0] for c in engine.calls] == ["add", "add"]  # no pause, no resume of its own

    engine = _Engine()
    engine.fail_add_at = 2
    with pytest.raises(ValueError, match="refused"):
        anyio.run(generate_batch, engine, _requests(4))
    kinds = [c[0] for c in engine.calls]
    assert kinds == ["pause", "add", "add", "resume", "abort"]
    assert len(engine.calls[-1][1]) == 2 and engine.calls[-1][2] is True


def test_batch_requests_are_checked_before_anything_is_added() -> None:
    good = {"prompt_token_ids": [1, 2], "max_tokens": 3, "temperature": 0.7, "seed": 5}
    request = BatchRequest.from_dict(good)
    assert request.prompt_token_ids == (1, 2) and request.top_p == 1.0 and not request.ignore_eos
    params = request.sampling_params()
    assert (params.seed, params.logprobs, params.temperature) == (5, 0, 0.7)
    for raw, words in [
        ({**good, "n": 2}, "unknown request fields ['n']"),
        ({k: v for k, v in good.items() if k != "temperature"}, "missing request fields"),
        ({**good, "temperature": math.inf}, "finite"),
        ({**good, "seed": MAX_SEED + 1}, "seed must be an integer"),
    ]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
            BatchRequest.from_dict(raw)
    engine = _Engine(chunked=True)
    with pytest.raises(ConfigError, match="vocabulary"):
        check_batch(engine, [BatchRequest(**{**good, "prompt_token_ids": [VOCAB]})])
    big = [BatchRequest(**{**good, "prompt_token_ids": [1] * 700, "max_tokens": 20})] * 3
    with pytest.raises(ConfigError, match="chunked prefill"):
        check_batch(engine, big)
    with pytest.raises(ConfigError, match="chunked prefill"):
        anyio.run(generate_batch, engine, big)
    assert engine.calls == []  # refused before the engine paused or took a request
    greedy = [BatchRequest(**{**good, "prompt_token_ids": [1] * 700, "max_tokens": 20,
                              "temperature": 0.0})] * 3  # fmt: skip
    check_batch(engine, greedy)  # no generator to rewind
    check_batch(_Engine(chunked=False), big)
    assert anyio.run(generate_batch, engine, big[:1])  # within the budget


def test_a_dense_load_labels_the_weights_and_keeps_them_when_it_fails() -> None:
    engine = _Engine(ranks=2)
    ok = [{"tensors": 24, "seconds": 0.5, "written": True},
          {"tensors": 24, "seconds": 0.25, "written": True}]  # fmt: skip
    engine.rpc = {"dcr_check_checkpoint": [{"tensors": 24}] * 2, "dcr_load_checkpoint": ok}
    gate = gate_of(engine)
    assert gate_of(engine) is gate and not gate.receivers
    anyio.run(gate.label, dense_record(0))
    loaded = anyio.run(load_checkpoint, engine, "ckpt", 1)
    assert (loaded.record, loaded.tensors, loaded.load_seconds) == (dense_record(1), 24, 0.5)
    assert [c for c in engine.calls if c[0] != "rpc"] == [
        ("label", "dcr:0:dense-0"), ("pause", "wait"), ("reset",), ("label", "dcr:1:dense-1"),
        ("resume",),
    ]  # fmt: skip
    assert gate.record == dense_record(1) and [c.record.version for c in gate.cycles] == [1]

    # A failed check: no pause, nothing changed.
    missing = CheckpointError("ckpt: no such checkpoint directory", check="missing")
    engine.rpc["dcr_check_checkpoint"] = [{"error": error_to_wire(missing)}] * 2
    engine.calls.clear()
    with pytest.raises(CheckpointError, match="worker 0: ckpt: no such"):
        anyio.run(load_checkpoint, engine, "ckpt", 2)
    assert engine.calls == [("rpc", "dcr_check_checkpoint")]

    # Refused by every worker before writing: the weights keep their label.
    engine.rpc["dcr_check_checkpoint"] = [{"tensors": 24}] * 2
    engine.rpc["dcr_load_checkpoint"] = [{"error": error_to_wire(missing), "written": False}] * 2
    engine.calls.clear()
    with pytest.raises(CheckpointError):
        anyio.run(load_checkpoint, engine, "ckpt", 2)
    assert [c[0] for c in engine.calls if c[0] != "rpc"] == ["pause", "resume"]
    assert gate.record == dense_record(1)

    # One worker failed after the other wrote: the weights are unknown until a load succeeds.
    engine.rpc["dcr_load_checkpoint"] = [ok[0], {"error": error_to_wire(missing),
                                                 "written": False}]  # fmt: skip
    engine.calls.clear()
    with pytest.raises(ConfigError) as info:
        anyio.run(load_checkpoint, engine, "ckpt", 2)
    assert info.value.check == PARTIAL_LOAD and "worker 1" in str(info.value)
    assert ("label", UNCONFIRMED) in engine.calls and engine.calls[-1] == ("resume",)
    assert gate.record is None and [c.record.version for c in gate.cycles] == [1]


def test_engines_in_a_fleet_take_no_dense_load_and_reference_gates_take_no_ranks() -> None:
    engine = _Engine()
    fleet_gate = EngineGate(engine, 1)
    with pytest.raises(ConfigError) as info:
        anyio.run(lambda: load_checkpoint(engine, "ckpt", 1, gate=fleet_gate))
    assert info.value.check == "fleet" and engine.calls == []
    with pytest.raises(ConfigError, match="receivers of a fleet"):
        anyio.run(fleet_gate.label, dense_record(0))
    reference = EngineGate(engine, 1, receivers=False)
    assert reference.state()["closed_by"] == []
    with pytest.raises(ConfigError, match="host no receivers"):
        anyio.run(reference.close, 0)


def test_the_digest_is_sha256_over_sorted_names_dtypes_shapes_and_stored_bytes() -> None:
    from dcr.integrations.vllm.worker import DcrWorkerExtension

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3).to(torch.bfloat16)
    model.head = torch.nn.Linear(3, 5, bias=False).to(torch.bfloat16)
    model.head.weight = model.embed.weight  # tied: counted under both names
    model.register_buffer("scale", torch.tensor(2.5))
    model.register_buffer("steps", torch.arange(4, dtype=torch.int64).reshape(2, 2).t())

    class Worker(DcrWorkerExtension):
        def get_model(self) -> torch.nn.Module:
            return model

    expected = hashlib.sha256()
    for name, t in sorted({"embed.weight": model.embed.weight, "head.weight": model.head.weight,
                           "scale": model.scale, "steps": model.steps}.items()):  # fmt: skip
        data = t.detach().contiguous()
        raw = bytes(data.untyped_storage())[: data.nbytes]  # a fresh tensor: offset 0
        shape = ",".join(map(str, data.shape))
        expected.update(f"{name}\0{str(data.dtype).removeprefix('torch.')}\0{shape}\0".encode())
        expected.update(len(raw).to_bytes(8, "little") + raw)
    worker = Worker()
    rank = worker.dcr_digest()
    assert rank == expected.hexdigest()
    model.scale.copy_(torch.tensor(-2.5))
    assert worker.dcr_digest() != rank

    engine = _Engine(ranks=2)
    engine.rpc = {"dcr_digest": [rank, "00" * 32]}
    digest = anyio.run(weights_digest, engine)
    assert digest.ranks == (rank, "00" * 32)
    assert digest.sha256 == hashlib.sha256(bytes.fromhex(rank) + bytes(32)).hexdigest()
    assert digest.as_dict()["ranks"] == 2
