"""FSDP2 / DTensor trainers as the source: each rank's local shards of DTensor parameters.

``torch.distributed.fsdp.fully_shard`` turns every parameter into a DTensor sharded along
dim 0 (``Shard(0)``) over the data-parallel mesh; other stacks place DTensors with ``Shard(d)``
on any dimension, over several mesh dimensions, or ``Replicate()`` them (HSDP).  Whatever the
placements, a rank's local tensor is one box of the full parameter, which the DTensor's own
metadata locates (global shape, mesh coordinate, placements).  :class:`FsdpSource` maps each
local tensor affinely into the canonical tensor of the parameter's name
(:class:`~dcr.delta.mapping.SubTensor`), with no gather and no conversion step; ranks holding
the same box (``Replicate`` dimensions) are replicas, compared once.

This serves the stacks that train with FSDP (verl, TRL, OpenRLHF): canonical names are the
module's parameter names, which for a Hugging Face model are its checkpoint names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from dcr.adapters.sources.sharded import LocalShard, RankSource
from dcr.delta.mapping import AffineMapping, Direct, SubTensor, Tied
from dcr.errors import ConfigError
from dcr.tensors.records import TensorSpec

__all__ = ["FsdpSource"]


class FsdpSource(RankSource):
    """This rank's shards of ``module``'s (DTensor) parameters.

    ``dtype`` casts every shard to the serving dtype (a bf16 rollout fed by a trainer that
    keeps fp32 parameters as master weights under FSDP2's ``MixedPrecisionPolicy``): the cast
    is element-wise, so each rank casts its own shard and the result projects affinely; it
    costs one copy of the rank's shards per version.  ``skip`` names parameters the serving
    checkpoint leaves out.  A parameter shared under several names (a tied output head) is
    one shard projecting to every name.  Parameters that are not DTensors are replicated on
    every rank.  Construction is collective over ``group`` (default: the default group; gloo
    for CPU tensors); see :class:`~dcr.adapters.sources.sharded.RankSource`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        skip: Iterable[str] = (),
        validate: bool = True,
    ) -> None:
        from torch.distributed.tensor import DTensor

        skipped = set(skip)
        names: dict[int, list[str]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if name in skipped:
                continue
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
        if not params:
            raise ConfigError("the module has no parameters to refit")
        shards = []
        for pid, p in params.items():
            name, *also = names[pid]
            if isinstance(p, DTensor):
                shards.append(_dtensor_shard(name, tuple(also), p, dtype))
            else:
                shards.append(_whole_shard(name, tuple(also), p, dtype))
        super().__init__(shards, {}, group=group, validate=validate)


def _reader(
    local: Callable[[], torch.Tensor], dtype: torch.dtype | None
) -> Callable[[], torch.Tensor]:
    if dtype is None:
        return lambda: local().detach()
    return lambda: local().detach().to(dtype)


def _tied(inner: AffineMapping, also: tuple[str, ...]) -> AffineMapping:
    return Tied(inner, also) if also else inner


def _specs(
    names: Iterable[str], shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name=n, shape=shape, dtype=dtype) for n in names)


def _whole_shard(
    name: str, also: tuple[str, ...], p: torch.nn.Parameter, dtype: torch.dtype | None
) -> LocalShard:
    shape = tuple(p.shape)
    out = dtype or p.dtype
    return LocalShard(
        key=name,
        source_name=name,
        read=_reader(lambda: p, dtype),
        mapping=_tied(Direct(name, shape), also),
        catalog=_specs((name, *also), shape, out),
    )


def _dtensor_shard(
    name: str, also: tuple[str, ...], p: torch.Tensor, dtype: torch.dtype | None
) -> LocalShard:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(p, DTensor)
    for placement in p.placements:
        # Exact types: a strided shard (FSDP2 over TP) interleaves chunks and is no single box;
        # a partial placement holds summands, not the parameter.
        if type(placement) not in (Shard, Replicate):
            raise ConfigError(
                f"placement {placement} is not supported (Shard(d) and Replicate() are)",
                tensor=name,
                check="placement",
            )
    shape = tuple(p.shape)
    local_shape, offset = compute_local_shape_and_global_offset(
        p.shape, p.device_mesh, p.placements
    )
    local_shape, offset = tuple(local_shape), tuple(offset)
    local = p.to_local()
    if tuple(local.shape) != local_shape:
        raise ConfigError(
            f"local tensor is {list(local.shape)}, its placements give {list(local_shape)}",
            tensor=name,
            check="placement",
        )
    whole = local_shape == shape
    inner: AffineMapping = (
        Direct(name, shape) if whole else SubTensor(name, shape, offset, local_shape)
    )
    out = dtype or p.dtype
    return LocalShard(
        key=name if whole else f"{name}@{','.join(map(str, offset))}",
        source_name=name,
        read=_reader(p.to_local, dtype),
        mapping=_tied(inner, also),
        catalog=_specs((name, *also), shape, out),
    )
