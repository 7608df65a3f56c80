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

Requests on the engine, labelled with the weight versions that produced their tokens, and
reproducible seeded batches are in :mod:`~dcr.integrations.vllm.generation`; dense reloads of
a reference engine outside any fleet and the digest of its weights in
:mod:`~dcr.integrations.vllm.checkpoint`.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from dcr.errors import ConfigError
from dcr.integrations.vllm.gate import EngineGate, GateServer, PauseMode, serving
from dcr.integrations.vllm.join import JoinSpec, error_from_wire
from dcr.protocol.types import CommitRecord
from dcr.wire.seal import seal_keys

if TYPE_CHECKING:
    from dcr.fleet.config import FleetConfig

__all__ = [
    "EngineReceivers",
    "gate_of",
    "join_fleet",
    "parameter_bits",
]


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


# -- the engine's gate ---------------------------------------------------------------------

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
    fleet: str | Path | FleetConfig,
    names: Sequence[str],
    *,
    checkpoint_version: int | None = None,
    checkpoint: str | Path | None = None,
    pause_mode: PauseMode | None = None,
    apply_threads: int | None = None,
    gate_timeout_s: float = 3600.0,
    report_fingerprints: bool = False,
    fleet_secret: bytes | None = None,
) -> AsyncIterator[EngineReceivers]:
    """Make the workers of ``engine`` receivers ``names`` (one per worker rank) of the fleet
    described by the fleet file ``fleet``, for the duration of the block.  ``fleet`` may also
    be a fleet config (:func:`dcr.ray.fleet_config` on Ray): its file, with the relay
    addresses it knows.

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
    ``fleet_secret`` is the fleet's 32-byte secret (its key directory's,
    ``KeyDir(path).secret()``): every receiver then refuses payloads not sealed with it
    (:mod:`dcr.wire.seal`); it crosses to the engine's own workers only.
    """
    from dcr.fleet.config import FleetConfig, load_fleet

    if fleet_secret is not None:
        seal_keys(fleet_secret)  # a ConfigError unless 32 bytes, before any worker is asked
    if isinstance(fleet, FleetConfig):
        path, cfg = fleet.path.resolve(), fleet
    else:
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
            fleet_secret=fleet_secret,
            relay_addresses=dict(cfg.relay_addresses),
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
