"""What one owner's construction takes and gives (paper §6, App. C "Pipeline settings"):
its settings (:class:`BuildConfig`), its counters and stage seconds (:class:`BuildStats`), the
buckets it yields (:class:`Bucket`) and the residual tensors it compares (:class:`ResidualJob`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dcr.delta.fp8 import Fp8Stats
from dcr.errors import ConfigError
from dcr.tensors.parallel import default_threads
from dcr.tensors.records import Encoding, Item, TensorSpec

__all__ = ["DENSE_ABOVE", "BuildConfig", "BuildStats", "Bucket", "ResidualJob"]

MiB = 1 << 20
DENSE_ABOVE = 0.08
"""The default :attr:`BuildConfig.dense_above`: tensors with 8% of their elements changed or
more are sent whole (where a dense item starts to apply faster than sparse entries on the
torch-module and vLLM loaders, as ``dcr bench apply`` measures it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildConfig:
    """Construction settings (paper App. C "Pipeline settings").

    ``chunk_bytes``: tensors compared together (64 MiB suits object storage, 256 MiB the relay
    tree).  ``bucket_bytes``: input bytes of record-emitting chunks packed into one payload.
    Tensors and chunks are never split, so either can exceed its target.  ``threads``: worker
    threads one owner compares blocks on (``None``: the CPUs this process may use; 1: the
    calling thread).  Owners building at the same time in one process share them (one
    process-wide pool): while ``n`` owners build, one whose share ``threads // n`` is below
    two compares in the thread that drives its build (:func:`~dcr.tensors.parallel.ordered_map`).
    ``relative_encoding``: what mixed mode emits where a relative encoding is allowed --
    :attr:`Encoding.ULP` deltas for float dtypes (:data:`~dcr.tensors.ordered.ULP_DTYPES`; other
    dtypes keep XOR), the default, or :attr:`Encoding.XOR` masks everywhere (the paper's
    representation; payload format version 1 carries only these).
    ``dense_above``: the choice between sparse and dense per tensor.  A shard (or a residual
    tensor) of at least 65,536 elements with at least this fraction of them changed is sent as
    one dense overwrite of everything it projects -- span items, no index per element, applied
    by the receiver as block copies -- instead of sparse entries; ``None`` always sends sparse
    entries.  The default, :data:`DENSE_ABOVE` (8% changed), keeps a refit no slower to apply
    than a dense load and no larger than the dense bytes: below it sparse entries apply
    faster than the dense item, above it the dense item does, as ``dcr bench apply`` measures
    it (its ``break_even``, per loader: calibrate it for the receivers you run).  Sparse
    entries stay smaller in bytes at every rate, so a fleet whose link costs more than its
    receivers' apply time sets it higher (``0.5``: where packing the entries also starts to
    cost the owner more CPU than encoding the tensor whole).
    """

    chunk_bytes: int = 64 * MiB
    bucket_bytes: int = 512 * MiB
    threads: int | None = None
    relative_encoding: Encoding = Encoding.ULP
    dense_above: float | None = DENSE_ABOVE

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.bucket_bytes <= 0:
            raise ConfigError("chunk_bytes and bucket_bytes must be positive")
        if self.dense_above is not None and not 0.0 < self.dense_above <= 1.0:
            raise ConfigError(
                f"dense_above must be in (0, 1] or None (never dense), got {self.dense_above}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.relative_encoding not in (Encoding.XOR, Encoding.ULP):
            raise ConfigError(
                f"relative_encoding must be XOR or ULP, got {self.relative_encoding!r}"
            )

    @property
    def worker_threads(self) -> int:
        return self.threads if self.threads is not None else default_threads()


@dataclass(slots=True, kw_only=True)
class BuildStats:
    """Counters and stage seconds of one owner's construction.

    ``changed_elements`` counts canonical elements of projected tensors whose stored bits
    changed, each once: a shard copy that another rank projects (replicated key/value rows)
    counts nothing, a tied source element counts once per canonical tensor it lands in.
    Entries are counted per encoding (``xor_*``, ``ulp_*``, ``overwrite_*``).  Stage seconds
    are CPU seconds of the threads that ran them, summed over threads (``detect``: comparison
    and the gather of changed values; ``project``: canonical indices and encoded values;
    ``pack``: items of a bucket), except ``convert`` (wall seconds of residual conversion,
    which may use torch's own threads).
    """

    source_bytes: int = 0
    changed_elements: int = 0
    residual_changed: int = 0
    xor_items: int = 0
    overwrite_items: int = 0
    ulp_items: int = 0
    xor_entries: int = 0
    overwrite_entries: int = 0
    ulp_entries: int = 0
    dense_tensors: int = 0
    """Shards and residual tensors sent as a dense overwrite (``dense_above``)."""
    dense_elements: int = 0
    """Elements of those, sent whole."""
    fp8: Fp8Stats = field(default_factory=Fp8Stats)
    """FP8 rollout: tiles re-quantized, FP8 values and scales changed."""
    seconds: dict[str, float] = field(default_factory=dict)

    def add_time(self, stage: str, dt: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + dt

    def merge(self, other: BuildStats) -> None:
        for f in (
            "source_bytes",
            "changed_elements",
            "residual_changed",
            "xor_items",
            "overwrite_items",
            "ulp_items",
            "xor_entries",
            "overwrite_entries",
            "ulp_entries",
            "dense_tensors",
            "dense_elements",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.seconds.items():
            self.add_time(k, v)
        for f in ("tiles", "tiles_touched", "fp8_changed", "scales_changed", "dense"):
            setattr(self.fp8, f, getattr(self.fp8, f) + getattr(other.fp8, f))


@dataclass(slots=True, kw_only=True)
class Bucket:
    """Items of one payload, with the input bytes of the chunks they came from."""

    items: list[Item]
    input_bytes: int
    final: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ResidualJob:
    """A residual canonical tensor this owner assembles and compares.

    ``candidate`` returns the converted candidate tensor (assembled from every owner's parts);
    the owner compares it with its residual baseline.
    """

    spec: TensorSpec
    candidate: Callable[[], torch.Tensor]
