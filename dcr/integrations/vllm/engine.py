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
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from dcr.errors import ConfigError
from dcr.integrations.vllm.gate import EngineGate, GateServer, PauseMode, serving
from dcr.integrations.vllm.join import JoinSpec, error_from_wire
from dcr.integrations.vllm.versions import WeightSpan, weight_spans
from dcr.protocol.types import CommitRecord

__all__ = ["EngineReceivers", "Generation", "generate", "join_fleet", "parameter_bits"]


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


@dataclass(slots=True)
class EngineReceivers:
    """The receivers of one running engine, one per worker, and the engine's gate."""

    engine: Any
    names: tuple[str, ...]
    gate: EngineGate
    server: GateServer
    held: CommitRecord | None
    """What the engine's weights held when it joined (``None``: restored by dense refit)."""

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

    from dcr.delta.bits import numpy_bits_dtype

    return {
        name: np.frombuffer(data, dtype=numpy_bits_dtype(getattr(torch, dtype))).reshape(shape)
        for name, (dtype, shape, data) in raw.items()
    }


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
    try:
        async with serving(server):
            yield EngineReceivers(
                engine=engine, names=tuple(names), gate=gate, server=server, held=held
            )
    finally:
        with anyio.CancelScope(shield=True):
            await engine.collective_rpc("dcr_leave")
