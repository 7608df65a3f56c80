"""The engine-process side: a running vLLM engine's workers join a refit fleet as receivers.

Start the engine (``AsyncLLM``) with ``worker_extension_cls=`` :data:`~dcr.integrations.vllm.
EXTENSION` (and, on CPU, ``load_format=`` :data:`~dcr.integrations.vllm.PLAIN_WEIGHTS`), then::

    async with join_fleet(engine, "fleet.toml", ["r0", "r1"]) as receivers:
        out = await generate(engine, prompt_token_ids, params)   # out.spans: weight versions
        ...

:func:`join_fleet` opens the engine's request gate (:class:`~dcr.integrations.vllm.gate.
EngineGate`) for the workers' receiver ranks, decides what the engine's weights hold (the
committed record when the engine was started from that version's checkpoint, else nothing:
the receivers restore it by dense refit, the engine paused meanwhile), and has every worker
join through ``collective_rpc``.  A worker that cannot take in-place refits (weights repacked
by the CPU backend) makes it raise :class:`~dcr.errors.LoaderPathUnsupported` with every
worker left as it was.

For runs that must be reproducible bit for bit (an RL loop whose delta-refit run and
dense-reload run must sample the same tokens):

* :func:`generate_batch` runs a batch of seeded requests whose requests all enter the
  scheduler at one step, on an otherwise idle engine, so the same weights and the same batch
  give the same tokens and log probabilities in any engine process;
* :func:`load_checkpoint` replaces the weights of an engine outside any fleet (a reference
  engine) by a full checkpoint, through the workers' own ``model.load_weights``, and labels
  them with :func:`~dcr.integrations.vllm.versions.dense_record` of its version;
* :func:`weights_digest` is a SHA-256 over the stored bits of every worker's parameters and
  buffers, computed in the workers.

Why batches are admitted together: vLLM's engine core handles the requests it has received
between two scheduler steps, so requests added one after another (``AsyncLLM.add_request``
sends each on its own) can start at different steps, or join requests already decoding;
and on CPU the bits of a bf16 GEMM row can depend on how many rows the step computes (the
kernel blocks the problem by its size), so the tokens a seeded request samples depend on
which other requests shared its steps.  Two further engine settings keep a batch
reproducible: without the prefix cache (``enable_prefix_caching=False``) every prompt token
is computed in the batch's own steps, whatever earlier batches left cached (a cache hit
skips tokens and so changes the steps' row counts), and vLLM 0.32 on CPU fails
a seeded request whose prefill is split across steps (chunked prefill rewinds the request's
generator, which a CPU generator cannot), which :func:`generate_batch` refuses to risk unless
chunked prefill is off or the batch fits one step's token budget.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from dcr.errors import ConfigError
from dcr.integrations.vllm.gate import EngineGate, GateServer, PauseMode, serving
from dcr.integrations.vllm.join import JoinSpec, error_from_wire
from dcr.integrations.vllm.versions import WeightSpan, dense_record, weight_spans
from dcr.protocol.types import CommitRecord

__all__ = [
    "MAX_SEED",
    "PARTIAL_LOAD",
    "BatchRequest",
    "DenseLoad",
    "EngineReceivers",
    "Generation",
    "WeightsDigest",
    "check_batch",
    "gate_of",
    "generate",
    "generate_batch",
    "join_fleet",
    "load_checkpoint",
    "parameter_bits",
    "weights_digest",
]

MAX_SEED = 2**63 - 1
"""Largest per-request sampling seed (torch generators take 64-bit seeds)."""

PARTIAL_LOAD = "partial-load"
"""``check`` of the error raised when a dense load failed after workers began writing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One finished request: its tokens, the log probability of each, and which committed
    version produced which tokens (``spans``; two or more when it straddled a refit)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    spans: tuple[WeightSpan, ...]

    @property
    def record(self) -> CommitRecord | None:
        """The committed record that produced every token, or ``None`` when the request
        straddled a refit or ran on weights no receiver confirmed."""
        records = {s.record for s in self.spans}
        return records.pop() if len(records) == 1 else None

    @property
    def switches(self) -> tuple[int, ...]:
        """Indices of the first output token generated after each change of weights."""
        return tuple(s.start for s in self.spans[1:])

    def as_dict(self) -> dict[str, Any]:
        record = self.record
        return {
            "request_id": self.request_id,
            "token_ids": list(self.token_ids),
            "logprobs": None if self.logprobs is None else list(self.logprobs),
            "finish_reason": self.finish_reason,
            "version": None if record is None else record.version,
            "candidate": None if record is None else record.candidate,
            "weight_versions": [s.as_dict() for s in self.spans],
            "switches": list(self.switches),
        }


async def generate(
    engine: Any,
    prompt_token_ids: Sequence[int],
    params: Any,
    *,
    request_id: str | None = None,
    progress: Callable[[int], Awaitable[None]] | None = None,
) -> Generation:
    """Run one request on ``engine`` (a vLLM ``AsyncLLM``) to completion.

    While the gate is closed the request waits in the engine.  ``params`` are vLLM
    ``SamplingParams`` (``logprobs=0`` or more to get each sampled token's log probability).
    ``progress`` is awaited with the number of output tokens so far each time the engine
    reports some.  A request aborted meanwhile (``engine.abort(request_id)``) returns what it
    generated, with ``finish_reason="abort"`` and its weight spans.
    """
    rid = request_id or uuid.uuid4().hex
    final = None
    async for out in engine.generate({"prompt_token_ids": list(prompt_token_ids)}, params, rid):
        final = out
        if progress is not None and out.outputs and not out.finished:
            await progress(len(out.outputs[0].token_ids))
    return _generation(rid, final)


def _generation(rid: str, final: Any) -> Generation:
    """The :class:`Generation` of request ``rid`` from its last (finished) ``RequestOutput``."""
    if final is None or not final.outputs:
        raise ConfigError(f"request {rid} finished without output", check="generate")
    completion = final.outputs[0]
    logprobs = None
    if completion.logprobs is not None:
        logprobs = tuple(
            float(step[token].logprob)
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        )
    return Generation(
        request_id=rid,
        token_ids=tuple(int(t) for t in completion.token_ids),
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        spans=weight_spans(completion),
    )


# -- batches ------------------------------------------------------------------------------

_REQUEST_FIELDS = ("prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "ignore_eos")
_REQUIRED_FIELDS = ("prompt_token_ids", "max_tokens", "temperature", "seed")


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRequest:
    """One request of a batch (:func:`generate_batch`): a token prompt, sampled with its own
    seed.

    ``temperature`` 0 samples greedily; otherwise tokens are drawn at ``temperature`` from
    the ``top_p`` nucleus by a generator seeded with ``seed`` (vLLM's per-request
    ``SamplingParams(seed=...)``), so the draws depend on the request alone.  Each token's
    log probability is reported (``logprobs=0``: the sampled token's), as vLLM computes it:
    from the model's raw logits, before temperature and top-p.
    """

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        prompt = self.prompt_token_ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ConfigError("prompt_token_ids must be a non-empty list of token ids")
        if not all(type(t) is int and t >= 0 for t in prompt):
            raise ConfigError("prompt_token_ids must hold non-negative integers only")
        object.__setattr__(self, "prompt_token_ids", tuple(prompt))
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if type(self.ignore_eos) is not bool:
            raise ConfigError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @classmethod
    def from_dict(cls, raw: object) -> BatchRequest:
        """A request from its JSON form: ``{"prompt_token_ids", "max_tokens", "temperature",
        "seed"}`` and optionally ``"top_p"`` (1.0) and ``"ignore_eos"`` (false); any other key
        is refused (:class:`~dcr.errors.ConfigError`)."""
        if not isinstance(raw, dict):
            raise ConfigError("a request must be a JSON object")
        unknown = sorted(set(raw) - set(_REQUEST_FIELDS))
        if unknown:
            raise ConfigError(f"unknown request fields {unknown}; known: {list(_REQUEST_FIELDS)}")
        missing = [k for k in _REQUIRED_FIELDS if k not in raw]
        if missing:
            raise ConfigError(f"missing request fields {missing}")
        return cls(**raw)

    def sampling_params(self) -> Any:
        """vLLM ``SamplingParams`` of the request (imports vLLM)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=0,
            detokenize=False,
        )


def check_batch(engine: Any, requests: Sequence[BatchRequest]) -> None:
    """Refuse (:class:`~dcr.errors.ConfigError`) a batch ``engine`` cannot run as one: a token
    id outside the model's vocabulary, a request longer than the model's context, or -- on a
    CPU engine with chunked prefill -- seeded sampled requests whose prompts and outputs
    together could exceed one step's token budget (vLLM 0.32 then splits a prefill across
    steps, whose rewind of the request's generator fails on CPU and stops the engine)."""
    config = engine.vllm_config
    vocab = int(config.model_config.get_vocab_size())
    max_len = int(config.model_config.max_model_len)
    for i, r in enumerate(requests):
        top = max(r.prompt_token_ids)
        if top >= vocab:
            raise ConfigError(
                f"request {i}: token id {top} outside the model's vocabulary of {vocab}"
            )
        if len(r.prompt_token_ids) + r.max_tokens > max_len:
            raise ConfigError(
                f"request {i}: {len(r.prompt_token_ids)} prompt tokens + max_tokens "
                f"{r.max_tokens} exceed the model's context of {max_len} tokens"
            )
    scheduler = config.scheduler_config
    seeded = any(r.temperature > 0 for r in requests)
    if seeded and scheduler.enable_chunked_prefill and _on_cpu(config):
        need = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
        budget = int(scheduler.max_num_batched_tokens)
        threshold = int(getattr(scheduler, "long_prefill_token_threshold", 0) or 0)
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
        if need > budget or 0 < threshold < longest:
            raise ConfigError(
                f"the batch needs up to {need} tokens in one step, more than the engine's "
                f"budget of {budget}: vLLM would split a seeded request's prefill across steps, "
                "which fails on CPU; start the engine with chunked prefill off "
                "(--no-chunked-prefill, enable_chunked_prefill=False) or send smaller batches"
            )


def _on_cpu(config: Any) -> bool:
    return str(getattr(config.device_config, "device_type", "")) == "cpu"


async def generate_batch(
    engine: Any,
    requests: Iterable[BatchRequest],
    *,
    gate: EngineGate | None = None,
    admitted: Callable[[], Awaitable[None]] | None = None,
) -> list[Generation]:
    """Run ``requests`` on ``engine`` (a vLLM ``AsyncLLM``) as one batch; their
    :class:`Generation` s in request order.

    Every request of the batch enters the scheduler at the same step: under ``gate``'s lock
    (by default :func:`gate_of` the engine) the engine is paused until the requests in flight
    finished, all requests are added, and it resumes (:meth:`EngineGate.admit`).  With the
    same weights and engine settings, the same batch then gives the same tokens and log
    probabilities, bit for bit, in any engine process and after any restart -- provided no
    other request arrives while the batch runs (one joining it changes its steps), the prefix
    cache is off or empty, and the engine's threads are fixed (``OMP_NUM_THREADS``).  While
    a refit holds the gate closed the requests wait and all start when it reopens (with the
    requests it froze, in ``"keep"`` mode).  Raises :class:`~dcr.errors.ConfigError` for a
    batch the engine cannot run as one (:func:`check_batch`) before adding any request; when
    the call is cancelled or fails, the batch's requests are aborted.  ``admitted`` is
    awaited once the engine holds every request of the batch, before they finish (a caller
    that must know the batch runs on the weights the engine holds now, before it starts a
    refit).
    """
    batch = list(requests)
    if not batch:
        return []
    check_batch(engine, batch)
    params = [r.sampling_params() for r in batch]
    gate = gate if gate is not None else gate_of(engine)
    stem = uuid.uuid4().hex
    ids = [f"batch-{stem}-{i}" for i in range(len(batch))]
    queues: list[Any] = []

    async def add() -> None:
        for rid, request, p in zip(ids, batch, params, strict=True):
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
            queues.append(await engine.add_request(rid, prompt, p))

    try:
        await gate.admit(add)
        if admitted is not None:
            await admitted()
        finals = [await _finished(q) for q in queues]
    except BaseException:
        with anyio.CancelScope(shield=True):
            if queues:
                await engine.abort([q.request_id for q in queues], internal=True)
        raise
    finally:
        for q in queues:
            q.close()
    return [_generation(rid, final) for rid, final in zip(ids, finals, strict=True)]


async def _finished(queue: Any) -> Any:
    """The last output of a request from its output collector (``AsyncLLM.add_request``)."""
    while True:
        out = queue.get_nowait() or await queue.get()
        if out.finished:
            return out


@dataclass(slots=True)
class EngineReceivers:
    """The receivers of one running engine, one per worker, and the engine's gate."""

    engine: Any
    names: tuple[str, ...]
    gate: EngineGate
    server: GateServer
    held: CommitRecord | None
    """What the engine's weights held when it joined (``None``: restored by dense refit)."""
    prewarm: tuple[dict[str, Any], ...] = ()
    """Each worker's prewarm: how many tensors its loader keeps bit for bit (they travel
    relative to the old bits) and which it transforms (they travel as overwrites)."""

    def describe(self) -> list[str]:
        """One line per worker: what its prewarm decided and why."""
        lines = []
        for name, p in zip(self.names, self.prewarm, strict=False):
            refused = p.get("refused") or []
            lines.append(
                f"receiver {name}: {p.get('names')} tensors, {p.get('xor_allowed')} kept bit for "
                f"bit by vLLM's loader (sent relative to the old bits), "
                f"{p.get('transforming')} transformed (sent as overwrites"
                + (f": {', '.join(refused)}" if refused else "")
                + f"), {p.get('skipped')} held by other ranks; prewarm {p.get('seconds', 0):.2f} s"
            )
        return lines

    async def status(self) -> list[dict[str, Any] | None]:
        """Each worker's receiver: phase, held record, gate, applied payloads, seconds."""
        result: list[dict[str, Any] | None] = await self.engine.collective_rpc("dcr_status")
        return result

    async def parameters(self) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Each worker's parameters and buffers as integer views of their stored bits."""
        ranks = await self.engine.collective_rpc("dcr_parameters")
        return [parameter_bits(rank) for rank in ranks]

    def state(self) -> dict[str, Any]:
        return {"receivers": list(self.names), **self.gate.state()}


def parameter_bits(
    raw: dict[str, tuple[str, Sequence[int], bytes]],
) -> dict[str, np.ndarray[Any, Any]]:
    """Integer views of the stored bits a worker's ``dcr_parameters`` returned."""
    import torch

    from dcr.tensors.bits import numpy_bits_dtype

    return {
        name: np.frombuffer(data, dtype=numpy_bits_dtype(getattr(torch, dtype))).reshape(shape)
        for name, (dtype, shape, data) in raw.items()
    }


# -- the engine's gate, dense loads, digests ------------------------------------------------

_GATES: weakref.WeakKeyDictionary[Any, EngineGate] = weakref.WeakKeyDictionary()


def _workers(engine: Any) -> int:
    return int(engine.vllm_config.parallel_config.world_size)


def gate_of(engine: Any) -> EngineGate:
    """The request gate of ``engine``: its receivers' while :func:`join_fleet`'s block runs,
    else a gate without receivers made on first use (one per engine), so batches and dense
    loads on one engine never interleave."""
    gate = _GATES.get(engine)
    if gate is None:
        gate = EngineGate(engine, _workers(engine), receivers=False)
        _GATES[engine] = gate
    return gate


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseLoad:
    """A full checkpoint loaded into a running engine (:func:`load_checkpoint`)."""

    record: CommitRecord
    """The record the engine's weights are labelled with now (``dense-<version>``)."""
    tensors: int
    """Checkpoint tensors each worker passed to ``model.load_weights``."""
    seconds: float
    """Wall-clock seconds of the whole load: check, pause (requests in flight finished),
    load, cache reset, resume."""
    load_seconds: float
    """Seconds the slowest worker spent reading the files and in ``model.load_weights``."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.record.version,
            "candidate": self.record.candidate,
            "tensors": self.tensors,
            "seconds": self.seconds,
            "load_seconds": self.load_seconds,
        }


def _raise_failed(results: Sequence[Mapping[str, Any]]) -> None:
    for worker, result in enumerate(results):
        if "error" in result:
            raise error_from_wire(result["error"], worker)


async def load_checkpoint(
    engine: Any, path: str | Path, version: int, *, gate: EngineGate | None = None
) -> DenseLoad:
    """Load the full Hugging Face checkpoint directory ``path`` (safetensors and
    ``config.json``, the tensors of the checkpoint the engine was started from) into the
    running ``engine`` through every worker's own ``model.load_weights``, and label its
    weights :func:`~dcr.integrations.vllm.versions.dense_record` ``(version)``.

    For engines outside any fleet (a reference run that reloads full checkpoints), started
    with the worker extension and, on CPU, the plain-weights load format.  First every worker
    checks the checkpoint without writing anything (``dcr_check_checkpoint``: readable
    safetensors headers, the same tensor names, shapes and dtypes and the same model type as
    the checkpoint the engine serves, weights not repacked); a failed check raises its error
    (:class:`~dcr.errors.CheckpointError`, :class:`~dcr.errors.ConfigError`,
    :class:`~dcr.errors.LoaderPathUnsupported`) and the engine serves on, unchanged.  Then,
    under ``gate`` (by default :func:`gate_of` the engine; one whose workers are receivers
    refuses with ``check="fleet"``), the engine pauses until the requests in flight finished,
    the workers load (``dcr_load_checkpoint``), the prefix and KV caches are dropped, the
    weights are labelled and the engine resumes.  A failure once the workers began writing
    raises :class:`~dcr.errors.ConfigError` with ``check=`` :data:`PARTIAL_LOAD`: the engine
    serves weights no version describes (labelled
    :data:`~dcr.integrations.vllm.versions.UNCONFIRMED`) until a load succeeds.
    """
    record = dense_record(version)
    gate = gate if gate is not None else gate_of(engine)
    gate.require_no_receivers()
    directory = str(Path(path).resolve())
    t0 = time.monotonic()
    _raise_failed(await engine.collective_rpc("dcr_check_checkpoint", args=(directory,)))
    async with gate.replacing() as swap:
        swap.writing()
        results = await engine.collective_rpc("dcr_load_checkpoint", args=(directory,))
        if not any(r.get("written", True) for r in results):
            swap.unchanged()
            _raise_failed(results)
        for worker, result in enumerate(results):
            if "error" in result:
                cause = error_from_wire(result["error"], worker)
                raise ConfigError(
                    f"loading {directory} failed after the workers began writing ({cause}); "
                    "the engine's weights hold no known version until a load succeeds",
                    tensor=cause.tensor,
                    check=PARTIAL_LOAD,
                ) from cause
        swap.done(record)
    return DenseLoad(
        record=record,
        tensors=int(results[0]["tensors"]),
        seconds=time.monotonic() - t0,
        load_seconds=max(float(r["seconds"]) for r in results),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsDigest:
    """SHA-256 of the stored bits of an engine's weights (:func:`weights_digest`)."""

    sha256: str
    ranks: tuple[str, ...]
    """Each worker rank's digest, in rank order."""

    def as_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "ranks": len(self.ranks), "rank_sha256": list(self.ranks)}


async def weights_digest(engine: Any) -> WeightsDigest:
    """The digest of every parameter and buffer of every worker of ``engine``, computed inside
    the workers (no tensor bytes cross processes).

    Each worker rank ``r`` computes ``d_r`` = SHA-256 over its model's parameters and buffers
    (``named_parameters`` and ``named_buffers`` with ``remove_duplicate=False``, so a tied
    tensor counts under each of its names), in sorted name order, each as the UTF-8 bytes of
    ``"<name>\\0<dtype>\\0<d0>,<d1>,...\\0"`` (torch dtype name such as ``bfloat16``, shape in
    decimal, empty for a scalar), then the byte count of its data as an 8-byte little-endian
    integer, then its data: the stored bytes of the contiguous tensor, in row-major order.
    The engine's digest is SHA-256 over ``d_0 || d_1 || ...`` (the 32-byte digests in rank
    order).  Two engines have equal digests exactly when they have the same tensor
    parallelism and every worker holds the same names, dtypes, shapes and stored bits (up to
    SHA-256 collisions): the ``final_weights_sha256`` of a run.
    """
    ranks = tuple(str(h) for h in await engine.collective_rpc("dcr_digest"))
    combined = hashlib.sha256(b"".join(bytes.fromhex(h) for h in ranks)).hexdigest()
    return WeightsDigest(sha256=combined, ranks=ranks)


async def _committed(fleet: Path) -> CommitRecord:
    from dcr.fleet.config import load_fleet
    from dcr.fleet.runtime import make_store

    store = make_store(load_fleet(fleet))
    try:
        return (await store.read()).record
    finally:
        await store.close()


@asynccontextmanager
async def join_fleet(
    engine: Any,
    fleet: str | Path,
    names: Sequence[str],
    *,
    checkpoint_version: int | None = None,
    checkpoint: str | Path | None = None,
    pause_mode: PauseMode | None = None,
    apply_threads: int | None = None,
    gate_timeout_s: float = 3600.0,
    report_fingerprints: bool = False,
) -> AsyncIterator[EngineReceivers]:
    """Make the workers of ``engine`` receivers ``names`` (one per worker rank) of the fleet
    described by the fleet file ``fleet``, for the duration of the block.

    Raises the worker's error (a :class:`~dcr.errors.DcrError`: repacked weights, a fleet file
    that does not match the engine, a catalog that does not fit its model) before the block
    when a worker cannot join; every worker then leaves and the engine serves as before.

    ``checkpoint`` is a Hugging Face checkpoint directory whose catalog (names, shapes and
    dtypes from its safetensors headers, :func:`dcr.catalog.read_catalog`) the receivers
    take instead of the fleet file's (``[model] checkpoint``, else its synthetic model) --
    usually the checkpoint the engine serves.  Each worker checks it against its model at
    prewarm: every tensor must load, every parameter must be filled.  The owners must build
    payloads against the same catalog.

    ``checkpoint_version`` is the version whose checkpoint the engine was started from: when
    it is the committed version, the engine keeps serving and the receivers join at the
    committed record (the proof of the base version checks that at their first prepare);
    otherwise the gate closes and the receivers first restore the committed version by a
    dense refit.  ``pause_mode`` is how the gate pauses the engine: ``"wait"`` (in-flight
    requests finish first), ``"keep"`` (in-flight requests freeze and finish on the new
    weights, reporting both versions) or ``"abort"``; by default each attempt pauses as its
    RL mode wants, ``"wait"`` when synchronous and ``"keep"`` when asynchronous.
    ``report_fingerprints`` has every receiver report, in the fleet's event files, the
    fingerprint of each version it holds (what ``dcr fleet`` checks engines by).
    """
    from dcr.fleet.config import load_fleet

    path = Path(fleet).resolve()
    cfg = load_fleet(path)
    workers = int(engine.vllm_config.parallel_config.world_size)
    if len(names) != workers:
        raise ConfigError(f"{workers} workers need {workers} receiver names, got {list(names)}")
    for rank, name in enumerate(names):
        declared = cfg.receiver(name)
        if (declared.tp, declared.rank) != (workers, rank):
            raise ConfigError(
                f"receiver {name!r} is declared as rank {declared.rank} of tp={declared.tp}, "
                f"but it would run as worker {rank} of {workers}",
                check="layout",
            )
    record = await _committed(path)
    held = record if checkpoint_version == record.version else None
    gate = EngineGate(engine, workers, pause_mode=pause_mode)
    server = GateServer(gate)  # bound now: calls made before it serves wait in its queue
    try:
        for rank in range(workers):
            await gate.join(rank, held)
        spec = JoinSpec(
            fleet=str(path),
            names=tuple(names),
            gate=server.address,
            held=held,
            apply_threads=apply_threads,
            gate_timeout_s=gate_timeout_s,
            checkpoint=None if checkpoint is None else str(Path(checkpoint).resolve()),
            report_fingerprints=report_fingerprints,
        )
        results = await engine.collective_rpc("dcr_join", args=(spec.to_wire(),))
        failed = [(w, r["error"]) for w, r in enumerate(results) if "error" in r]
        if failed:
            await engine.collective_rpc("dcr_leave")
            raise error_from_wire(failed[0][1], failed[0][0])
    except BaseException:
        server.close()
        if gate.closed:  # serve again as before the join
            with anyio.CancelScope(shield=True):
                await engine.resume_generation()
        raise
    before = _GATES.get(engine)
    _GATES[engine] = gate  # batches on this engine go through the receivers' gate
    try:
        async with serving(server):
            yield EngineReceivers(
                engine=engine, names=tuple(names), gate=gate, server=server, held=held,
                prewarm=tuple(r.get("prewarm", {}) for r in results),
            )  # fmt: skip
    finally:
        if before is None:
            _GATES.pop(engine, None)
        else:
            _GATES[engine] = before
        with anyio.CancelScope(shield=True):
            await engine.collective_rpc("dcr_leave")
