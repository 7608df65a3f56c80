"""Sources whose shards are a distributed trainer's own parameters, one process per rank.

Each trainer process describes the shards it holds -- a key, the affine mapping that projects
the shard into canonical coordinates (or none: a tensor converted by residual conversion), its
shape and dtype -- and the descriptions are exchanged once over the trainer's process group
(gloo).  Every rank then builds the same global :class:`~dcr.delta.layout.TrainingPlan`: shards
with the same key on several ranks are replicas (data-parallel copies, tensor-parallel copies
of replicated parameters), one owner per replica group is elected by a stable name hash
(paper App. A.1, Fig. A.2), and the plan is checked to cover every canonical element exactly
once.  The exchange moves JSON text through ``all_gather`` of byte tensors; mappings are
rebuilt only from the classes of :mod:`dcr.delta.mapping`, nothing is unpickled.

Residual tensors are converted on every rank that holds them (the trainer's own conversion may
be collective); each becomes a *converted shard* ``name#converted``, held by those ranks and
compared by one of them, and a residual task with that shard as its only input, so its changed
elements travel as overwrite records (paper §4.3).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcr.adapters.sources.base import Source
from dcr.delta import mapping as affine
from dcr.delta.build import BuildConfig
from dcr.delta.dist import DistTrainingGroup
from dcr.delta.layout import ShardSpec, TrainingPlan, TrainLayout, stable_hash
from dcr.delta.mapping import AffineMapping, Direct
from dcr.delta.residual import ResidualPart, ResidualTask
from dcr.errors import ConfigError, LayoutError
from dcr.tensors.bits import DTYPE_CODES, dtype_name
from dcr.tensors.fp8 import Fp8Scheme
from dcr.tensors.records import TensorSpec

__all__ = ["CONVERTED", "LocalShard", "RankSource", "decode_mapping", "encode_mapping"]

CONVERTED = "#converted"
"""Suffix of the shard key under which a residual tensor's converted value is held."""

_MAPPINGS: dict[str, type[AffineMapping]] = {
    name: cls
    for name in affine.__all__
    if isinstance(cls := getattr(affine, name), type) and issubclass(cls, AffineMapping)
}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LocalShard:
    """One shard this rank holds: its key, how to read its current value and how it projects.

    ``key`` names the shard's content: ranks holding bitwise-identical copies use the same
    key (and describe the shard identically, ``tp_rank`` and ``ep_rank`` included).
    ``catalog`` gives the canonical tensors the mapping writes.
    """

    key: str
    source_name: str
    read: Callable[[], torch.Tensor]
    """The shard's value now (the trainer's live parameter, or a view or copy of it)."""
    mapping: AffineMapping
    catalog: tuple[TensorSpec, ...]
    tp_rank: int = 0
    ep_rank: int | None = None


def encode_mapping(m: AffineMapping) -> dict[str, Any]:
    """A JSON-ready description of a :mod:`dcr.delta.mapping` mapping."""
    cls = type(m).__name__
    if _MAPPINGS.get(cls) is not type(m):
        raise ConfigError(f"{cls} is not a mapping of dcr.delta.mapping", check="mapping")
    fields = {}
    for f in dataclasses.fields(m):  # type: ignore[arg-type]
        if f.init:
            fields[f.name] = _encode_value(getattr(m, f.name))
    return {"mapping": cls, "fields": fields}


def _encode_value(v: Any) -> Any:
    if isinstance(v, AffineMapping):
        return encode_mapping(v)
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    if v is None or isinstance(v, bool | int | str):
        return v
    raise ConfigError(f"cannot describe a mapping field of type {type(v).__name__}")


def decode_mapping(d: Any) -> AffineMapping:
    """The mapping :func:`encode_mapping` described; anything else raises :class:`LayoutError`."""
    if (
        not isinstance(d, dict)
        or set(d) != {"mapping", "fields"}
        or not isinstance(d["fields"], dict)
    ):
        raise LayoutError("malformed mapping description", check="mapping")
    cls = _MAPPINGS.get(d["mapping"]) if isinstance(d["mapping"], str) else None
    if cls is None:
        raise LayoutError(f"unknown mapping class {d['mapping']!r}", check="mapping")
    try:
        return cls(**{k: _decode_value(v) for k, v in d["fields"].items()})
    except TypeError as exc:
        raise LayoutError(f"bad {d['mapping']} description: {exc}", check="mapping") from exc


def _decode_value(v: Any) -> Any:
    if isinstance(v, dict):
        return decode_mapping(v)
    if isinstance(v, list):
        return tuple(_decode_value(x) for x in v)
    if v is None or isinstance(v, bool | int | str):
        return v
    raise LayoutError(f"bad mapping field {v!r}", check="mapping")


def _spec(d: Any) -> TensorSpec:
    name, shape, dtype = d
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(dt, torch.dtype) or dt not in DTYPE_CODES:
        raise LayoutError(f"unsupported dtype {dtype!r}", tensor=str(name), check="dtype")
    return TensorSpec(name=str(name), shape=tuple(int(x) for x in shape), dtype=dt)


def _describe(spec: TensorSpec) -> list[Any]:
    return [spec.name, list(spec.shape), dtype_name(spec.dtype)]


def _all_gather_text(text: str, group: dist.ProcessGroup | None) -> list[str]:
    """``text`` of every rank of ``group``, in rank order (CPU tensors: gloo)."""
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [t[: int(s.item())].numpy().tobytes().decode() for t, s in zip(out, sizes, strict=True)]


def _identity(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return inputs[0]


class RankSource(Source):
    """This rank's shards of a distributed trainer, with the plan of every rank's shards.

    ``shards`` are the affine shards this rank holds; ``converted`` the residual tensors it
    holds after conversion (canonical name to tensor).  Construction is collective over
    ``group`` (default: the default group), whose ranks number the plan's ranks; ``layout``
    describes them (default: ``TrainLayout(dp=world size)``).
    ``validate=True`` checks that the plan covers every canonical element exactly once.
    """

    def __init__(
        self,
        shards: Sequence[LocalShard],
        converted: Mapping[str, torch.Tensor],
        *,
        layout: TrainLayout | None = None,
        group: dist.ProcessGroup | None = None,
        validate: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("this source needs an initialised torch.distributed process group")
        world = dist.get_world_size(group)
        layout = layout or TrainLayout(dp=world)
        if layout.world_size != world:
            raise ConfigError(
                f"the layout has {layout.world_size} ranks, the process group {world}",
                check="training-group",
            )
        self.group = group
        self.rank = dist.get_rank(group)
        mine = {}
        dtypes = {}
        for s in shards:
            if s.key in mine:
                raise LayoutError("two local shards share a key", tensor=s.key)
            now = s.read()
            dtypes[s.key] = now.dtype
            if tuple(now.shape) != s.mapping.source_shape:
                raise LayoutError(
                    f"shard is {list(now.shape)}, its mapping expects "
                    f"{list(s.mapping.source_shape)}",
                    tensor=s.key,
                    check="shape",
                )
            mine[s.key] = s
        description = {
            "shards": [
                {
                    "key": s.key,
                    "source": s.source_name,
                    "mapping": encode_mapping(s.mapping),
                    "dtype": dtype_name(dtypes[s.key]),
                    "tp": s.tp_rank,
                    "ep": s.ep_rank,
                    "catalog": [_describe(c) for c in s.catalog],
                }
                for s in shards
            ],
            "converted": [_describe(TensorSpec.of(n, t)) for n, t in converted.items()],
        }
        texts = _all_gather_text(json.dumps(description, sort_keys=True), group)
        self._plan = _plan([json.loads(t) for t in texts], layout)
        if validate:
            self._plan.validate_coverage()
        self._local = mine
        self._base = self._read(converted)

    @property
    def plan(self) -> TrainingPlan:
        return self._plan

    def base_shards(self) -> Mapping[str, torch.Tensor]:
        """This rank's shards as they were when the source was built."""
        return self._base

    def candidate_shards(self, update: Any = None) -> Mapping[str, torch.Tensor]:
        """This rank's shards now, after the trainer's optimizer step (``update`` is unused:
        the trainer's parameters are the new version).  Collective when residual tensors are
        converted by a collective conversion: every rank calls it, in the same order."""
        if update is not None:
            raise ConfigError(
                f"{type(self).__name__} reads the trainer's parameters; call "
                "candidate_shards() without an update"
            )
        return self._read(self._convert())

    def _convert(self) -> Mapping[str, torch.Tensor]:
        """The residual tensors of the current version, converted (none by default)."""
        return {}

    def _read(self, converted: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shard tensors now: the affine shards' current values (CPU), and the
        converted residual tensors."""
        out = {key: _cpu(s.read()) for key, s in self._local.items()}
        for name, t in converted.items():
            out[name + CONVERTED] = _cpu(t)
        return out

    def training_group(
        self,
        *,
        config: BuildConfig | None = None,
        timeout_s: float = 300.0,
        fp8: Fp8Scheme | None = None,
    ) -> DistTrainingGroup:
        """The owner of this rank in the trainer's process group, at :meth:`base_shards`;
        ``fp8``: receivers serve the FP8 rollout of the catalog (``[model] rollout_dtype``).

        Collective: every rank calls it (it gathers the residual baseline).
        """
        return DistTrainingGroup(
            self.plan.with_fp8(fp8),
            self.rank,
            self.base_shards(),
            group=self.group,
            config=config,
            timeout_s=timeout_s,
        )


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t if t.device.type == "cpu" else t.to("cpu")


def _plan(ranks: list[dict[str, Any]], layout: TrainLayout) -> TrainingPlan:
    """The global plan from every rank's description (same result on every rank)."""
    catalog: dict[str, TensorSpec] = {}

    def learn(spec: TensorSpec) -> None:
        known = catalog.setdefault(spec.name, spec)
        if known != spec:
            raise LayoutError(
                f"ranks disagree on the canonical tensor: {known.dtype}{list(known.shape)} vs "
                f"{spec.dtype}{list(spec.shape)}",
                tensor=spec.name,
                check="catalog",
            )

    described: dict[str, dict[str, Any]] = {}
    replicas: dict[str, list[int]] = {}
    converted: dict[str, list[int]] = {}
    for rank, desc in enumerate(ranks):
        for d in desc["shards"]:
            key = d["key"]
            if described.setdefault(key, d) != d:
                raise LayoutError(
                    f"ranks {replicas[key][0]} and {rank} describe the same shard differently",
                    tensor=key,
                    check="replicas",
                )
            replicas.setdefault(key, []).append(rank)
            for c in d["catalog"]:
                learn(_spec(c))
        for c in desc["converted"]:
            spec = _spec(c)
            learn(spec)
            converted.setdefault(spec.name, []).append(rank)
    shards = []
    for key, d in described.items():
        mapping = decode_mapping(d["mapping"])
        dtype = _spec(["", [], d["dtype"]]).dtype
        for n in mapping.names:
            if n not in catalog:
                raise LayoutError("mapping writes an unknown tensor", tensor=n, check="catalog")
            if catalog[n].dtype != dtype:
                raise LayoutError(
                    f"shard {key!r} is {dtype}, the canonical tensor {catalog[n].dtype}: a cast "
                    "is not an affine mapping",
                    tensor=n,
                    check="dtype",
                )
        reps = tuple(replicas[key])
        shards.append(
            ShardSpec(
                key=key,
                source_name=d["source"],
                shape=mapping.source_shape,
                dtype=dtype,
                mapping=mapping,
                replicas=reps,
                owner=reps[stable_hash(d["source"]) % len(reps)],
                tp_rank=int(d["tp"]),
                ep_rank=None if d["ep"] is None else int(d["ep"]),
            )
        )
    residual = []
    for name, reps_list in converted.items():
        spec = catalog[name]
        reps = tuple(reps_list)
        key = name + CONVERTED
        shards.append(
            ShardSpec(
                key=key,
                source_name=name,
                shape=spec.shape,
                dtype=spec.dtype,
                mapping=None,
                replicas=reps,
                owner=reps[stable_hash(name) % len(reps)],
            )
        )
        residual.append(
            ResidualTask(
                spec=spec,
                parts=(
                    ResidualPart(
                        inputs=(key,), placement=Direct(name, spec.shape), convert=_identity
                    ),
                ),
                depends_on=frozenset({key}),
            )
        )
    if not catalog:
        raise LayoutError("the trainer holds no parameters", check="catalog")
    return TrainingPlan(
        layout=layout,
        family=None,
        catalog=catalog,
        shards=tuple(shards),
        residual=tuple(residual),
    )
