"""dcr receivers inside a running vLLM engine (vLLM 0.32), one per worker.

* :data:`EXTENSION` -- ``worker_extension_cls`` for the engine: a receiver in every worker,
  driven by ``collective_rpc`` (:mod:`~dcr.integrations.vllm.worker`);
* :data:`PLAIN_WEIGHTS` -- ``load_format`` for CPU engines: weights stay the plain tensors the
  loader writes, so in-place refit is exact (:mod:`~dcr.integrations.vllm.plain`);
* :func:`join_fleet` -- the engine's workers join a fleet; the engine's pause/resume is the
  request gate (:mod:`~dcr.integrations.vllm.engine`, :mod:`~dcr.integrations.vllm.gate`);
* :func:`generate`, :func:`weight_spans` -- which committed version produced which output
  tokens of a request (:mod:`~dcr.integrations.vllm.versions`);
* :func:`generate_batch`, :func:`load_checkpoint`, :func:`weights_digest` -- reproducible
  seeded batches, dense reloads of a reference engine's weights from full checkpoints, and
  the SHA-256 of an engine's weights (:mod:`~dcr.integrations.vllm.engine`);
* ``python -m dcr.integrations.vllm`` -- an engine process serving HTTP
  (:mod:`~dcr.integrations.vllm.server`).

Importing this package does not import vLLM; the names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcr.integrations.vllm.checkpoint import DenseLoad as DenseLoad
    from dcr.integrations.vllm.checkpoint import WeightsDigest as WeightsDigest
    from dcr.integrations.vllm.checkpoint import load_checkpoint as load_checkpoint
    from dcr.integrations.vllm.checkpoint import weights_digest as weights_digest
    from dcr.integrations.vllm.engine import EngineReceivers as EngineReceivers
    from dcr.integrations.vllm.engine import join_fleet as join_fleet
    from dcr.integrations.vllm.gate import EngineGate as EngineGate
    from dcr.integrations.vllm.gate import GateCycle as GateCycle
    from dcr.integrations.vllm.generation import BatchRequest as BatchRequest
    from dcr.integrations.vllm.generation import Generation as Generation
    from dcr.integrations.vllm.generation import generate as generate
    from dcr.integrations.vllm.generation import generate_batch as generate_batch
    from dcr.integrations.vllm.versions import WeightSpan as WeightSpan
    from dcr.integrations.vllm.versions import weight_spans as weight_spans

EXTENSION = "dcr.integrations.vllm.worker.DcrWorkerExtension"
"""``worker_extension_cls`` of an engine whose workers host dcr receivers."""

PLAIN_WEIGHTS = "dcr_plain"
"""``load_format`` that keeps a CPU engine's weights plain (see :mod:`.plain`)."""

_EXPORTS = {
    "BatchRequest": "dcr.integrations.vllm.generation",
    "DenseLoad": "dcr.integrations.vllm.checkpoint",
    "EngineGate": "dcr.integrations.vllm.gate",
    "EngineReceivers": "dcr.integrations.vllm.engine",
    "GateCycle": "dcr.integrations.vllm.gate",
    "Generation": "dcr.integrations.vllm.generation",
    "WeightSpan": "dcr.integrations.vllm.versions",
    "WeightsDigest": "dcr.integrations.vllm.checkpoint",
    "generate": "dcr.integrations.vllm.generation",
    "generate_batch": "dcr.integrations.vllm.generation",
    "join_fleet": "dcr.integrations.vllm.engine",
    "load_checkpoint": "dcr.integrations.vllm.checkpoint",
    "weight_spans": "dcr.integrations.vllm.versions",
    "weights_digest": "dcr.integrations.vllm.checkpoint",
}

__all__ = ["EXTENSION", "PLAIN_WEIGHTS", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcr.integrations.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
