"""A reference engine outside any fleet, for runs that must be reproducible bit for bit (an
RL loop's dense-reload run):

* :func:`load_checkpoint` replaces the weights of an engine outside any fleet (a reference
  engine) by a full checkpoint, through the workers' own ``model.load_weights``, and labels
  them with :func:`~dcr.integrations.vllm.versions.dense_record` of its version;
* :func:`weights_digest` is a SHA-256 over the stored bits of every worker's parameters and
  buffers, computed in the workers.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcr.errors import ConfigError
from dcr.integrations.vllm.engine import gate_of
from dcr.integrations.vllm.gate import EngineGate
from dcr.integrations.vllm.join import error_from_wire
from dcr.integrations.vllm.versions import dense_record
from dcr.protocol.types import CommitRecord

__all__ = [
    "PARTIAL_LOAD",
    "DenseLoad",
    "WeightsDigest",
    "load_checkpoint",
    "weights_digest",
]

PARTIAL_LOAD = "partial-load"
"""``check`` of the error raised when a dense load failed after workers began writing."""


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
