"""Requests on a running vLLM engine, each output token labelled with the committed version
that produced it: one request (:func:`generate`) or a batch of seeded requests that all enter
the scheduler at one step (:func:`generate_batch`), so the same weights and the same batch
give the same tokens and log probabilities in any engine process (runs that must be
reproducible bit for bit: an RL loop whose delta-refit run and dense-reload run must sample
the same tokens).

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

import math
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from dcr.errors import ConfigError
from dcr.integrations.vllm.engine import gate_of
from dcr.integrations.vllm.gate import EngineGate
from dcr.integrations.vllm.versions import WeightSpan, weight_spans
from dcr.protocol.types import CommitRecord

__all__ = [
    "MAX_SEED",
    "BatchRequest",
    "Generation",
    "check_batch",
    "generate",
    "generate_batch",
]

MAX_SEED = 2**63 - 1
"""Largest per-request sampling seed (torch generators take 64-bit seeds)."""


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
