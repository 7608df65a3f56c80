"""Residual conversion for tasks that are not element-wise (paper §4.3, App. A.1).

A residual task produces one canonical tensor from source shards through a conversion that is
not a fixed per-element index map: a shared scale factor, quantization, stacking with
transforms, a custom export hook.  Owners flag residual inputs whose stored bits changed; the
flags are OR-reduced over owners; every canonical tensor that depends on a flagged input (or
every residual tensor, when dependencies are unknown) is assembled on its residual owner from
the parts the owners converted, compared bitwise with the residual baseline, and its changed
elements become **overwrite** records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dcr.delta.mapping import AffineMapping
from dcr.errors import LayoutError
from dcr.tensors.bits import bits
from dcr.tensors.records import TensorSpec

__all__ = ["Convert", "ResidualPart", "ResidualTask", "ScaledCast", "assemble"]

Convert = Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ResidualPart:
    """One owner's contribution to a residual tensor.

    ``inputs`` are shard keys; the owner of ``inputs[0]`` converts the part using its local
    replicas of the others.  ``convert`` maps the input tensors to the converted part, of shape
    ``placement.source_shape`` and the canonical dtype; ``placement`` places the converted
    elements in the canonical tensor.
    """

    inputs: tuple[str, ...]
    placement: AffineMapping
    convert: Convert


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ResidualTask:
    """A canonical tensor built by residual conversion.

    ``depends_on`` lists the shard keys whose changes can alter the converted bits; ``None``
    means unknown (a custom export hook), which selects the tensor whenever any residual input
    changed (paper App. A.1 "Residual tasks").
    """

    spec: TensorSpec
    parts: tuple[ResidualPart, ...]
    depends_on: frozenset[str] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset(k for p in self.parts for k in p.inputs)

    def __post_init__(self) -> None:
        if not self.parts:
            raise LayoutError("a residual task needs at least one part", tensor=self.spec.name)
        for p in self.parts:
            if p.placement.names != (self.spec.name,):
                raise LayoutError(
                    f"part placement writes {p.placement.names}", tensor=self.spec.name
                )


@dataclass(frozen=True, slots=True)
class ScaledCast:
    """``converted = cast(source * scale)``: a shared scale factor makes this non-element-wise.

    A change of the scale alone changes many converted values while every other source value
    stays put, so a source XOR mask cannot carry over (paper Fig. D.1).
    """

    dtype: torch.dtype

    def __call__(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        source, scale = inputs
        return (source.to(torch.float32) * scale.to(torch.float32)).to(self.dtype)


def required_tensors(tasks: Iterable[ResidualTask], flagged: frozenset[str]) -> list[ResidualTask]:
    """The required tensor set ``U_req`` for the OR-reduced change flags ``flagged``."""
    tasks = list(tasks)
    if not flagged:
        return []
    if any(t.depends_on is None and t.inputs & flagged for t in tasks):
        return tasks
    out = []
    for t in tasks:
        deps = t.depends_on if t.depends_on is not None else t.inputs
        if deps & flagged:
            out.append(t)
    return out


def assemble(task: ResidualTask, converted: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """Build the canonical tensor of ``task`` from its converted parts (part index -> tensor).

    The parts must cover every element; where they overlap they must agree bit for bit
    (paper §4.3).  Raises :class:`LayoutError` otherwise.
    """
    spec = task.spec
    out = torch.empty(spec.shape, dtype=spec.dtype)
    seen = torch.zeros(spec.shape, dtype=torch.bool)
    for i, part in enumerate(task.parts):
        values = converted[i]
        if tuple(values.shape) != part.placement.source_shape or values.dtype != spec.dtype:
            raise LayoutError(
                f"converted part {i} is {values.dtype}{list(values.shape)}, expected "
                f"{spec.dtype}{list(part.placement.source_shape)}",
                tensor=spec.name,
                check="residual-part",
            )
        for (_, dst, src), (_, mask, _) in zip(
            part.placement.blocks({spec.name: out}, values),
            part.placement.blocks({spec.name: seen}, values),
            strict=True,
        ):
            if bool(mask.any()):
                overlap = mask
                if not bool((bits(dst)[overlap.numpy()] == bits(src)[overlap.numpy()]).all()):
                    raise LayoutError(
                        "overlapping residual parts disagree", tensor=spec.name, check="residual"
                    )
            dst.copy_(src)
            mask.fill_(True)
    if not bool(seen.all()):
        raise LayoutError(
            f"residual parts cover {int(seen.sum())} of {spec.numel} elements",
            tensor=spec.name,
            check="residual-coverage",
        )
    return out
