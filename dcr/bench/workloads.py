"""The updates the construct and apply benchmarks measure, and their notation.

A workload makes the next version of the benchmark model from the base:

- a fraction in (0, 1], e.g. ``0.03``: :func:`~dcr.models.updates.perturb` -- each element is
  chosen with that probability and updated as ``bf16(w * (1 + 0.01 * eps))`` (the paper's
  element change rates; some chosen elements keep their bits, so fewer words change);
- ``adamw:LR``, e.g. ``adamw:1e-5``: one real AdamW step at learning rate ``LR`` on fp32
  masters of the weights with synthetic gradients
  (:func:`~dcr.models.updates.adamw_update`): which words change follows the learning rate
  against each weight's bf16 spacing, as on a trainer.

``--rates`` of ``dcr bench construct`` and ``dcr bench apply`` take a comma-separated list
of both (:func:`parse_workloads`).  Each result row carries the workload's :attr:`label` and
the measured :func:`changed_fraction`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "Workload",
    "changed_fraction",
    "changed_text",
    "label_of",
    "new_version",
    "parse_workloads",
    "workloads",
]

ADAMW: Literal["adamw"] = "adamw"


@dataclass(frozen=True, slots=True)
class Workload:
    """One benchmark update: ``perturb`` with ``value`` the element change rate, or
    ``adamw`` with ``value`` the learning rate."""

    kind: Literal["perturb", "adamw"]
    value: float

    def __post_init__(self) -> None:
        if self.kind == "perturb":
            if not 0.0 < self.value <= 1.0:
                raise ValueError(f"a change rate must be a fraction in (0, 1], got {self.value}")
        elif self.kind == ADAMW:
            if not (self.value > 0.0 and math.isfinite(self.value)):
                raise ValueError(f"an AdamW learning rate must be positive, got {self.value}")
        else:
            raise ValueError(f"unknown workload kind {self.kind!r}")

    @classmethod
    def parse(cls, token: str) -> Workload:
        """``0.03`` (a change rate in (0, 1]) or ``adamw:1e-5`` (a learning rate > 0);
        :class:`ValueError` for anything else."""
        text = token.strip()
        kind, sep, rest = text.partition(":")
        try:
            if sep:
                if kind.strip().lower() != ADAMW:
                    raise ValueError(f"unknown workload {token!r}")
                return cls(ADAMW, float(rest))
            return cls("perturb", float(text))
        except ValueError as err:
            raise ValueError(
                f"expected a change rate in (0, 1] or adamw:LR (LR > 0), got {token!r}"
            ) from err

    @property
    def rate(self) -> float | None:
        """The element change rate of a ``perturb`` workload; ``None`` for AdamW."""
        return self.value if self.kind == "perturb" else None

    @property
    def label(self) -> str:
        """``"3%"``, ``"0.1%"``, ``"adamw lr=1e-05"``."""
        if self.kind == "perturb":
            return f"{self.value * 100:.3g}%"
        return f"adamw lr={self.value:g}"


def workloads(items: Iterable[float | Workload]) -> list[Workload]:
    """``items`` as workloads: a bare number is a change rate (as ``--rates`` always took)."""
    return [w if isinstance(w, Workload) else Workload("perturb", float(w)) for w in items]


def parse_workloads(text: str) -> list[Workload]:
    """A comma-separated list of workloads (:meth:`Workload.parse`), at least one."""
    out = [Workload.parse(token) for token in text.split(",") if token.strip()]
    if not out:
        raise ValueError(f"expected at least one workload, got {text!r}")
    return out


def new_version(
    base: Mapping[str, torch.Tensor], workload: Workload, seed: int
) -> dict[str, torch.Tensor]:
    """The next version of ``base`` under ``workload`` (a new dict; ``base`` is not changed)."""
    from dcr.models.updates import adamw_update, perturb

    if workload.kind == ADAMW:
        return adamw_update(base, lr=workload.value, seed=seed)
    return perturb(base, rate=workload.value, seed=seed)


def changed_fraction(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> float:
    """The fraction of all elements of ``base`` whose stored bits differ in ``new`` (compared
    as integers: ``+0``/``-0`` and NaN payloads count as changes)."""
    from dcr.tensors.bits import bits

    total = changed = 0
    for name, t in base.items():
        total += t.numel()
        if t.numel():
            changed += int(np.count_nonzero(bits(t).reshape(-1) != bits(new[name]).reshape(-1)))
    return changed / total if total else 0.0


def lines_fraction(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], line: int = 64
) -> float:
    """The fraction of ``line``-byte cache lines of the tensors (each laid out contiguously,
    lines counted from its first element) that hold at least one changed element.

    An in-place sparse apply reads and writes every such line, a dense load streams every
    line once each way: at memory bandwidth this fraction bounds a sparse apply's time over
    a dense load from below, however fast its per-entry work.
    """
    from dcr.tensors.bits import bits

    lines = touched = 0
    for name, t in base.items():
        n = t.numel()
        if not n:
            continue
        per = max(1, line // t.element_size())
        diff = bits(t).reshape(-1) != bits(new[name]).reshape(-1)
        pad = -n % per
        if pad:
            diff = np.concatenate([diff, np.zeros(pad, dtype=bool)])
        rows = diff.reshape(-1, per)
        lines += rows.shape[0]
        touched += int(np.count_nonzero(rows.any(axis=1)))
    return touched / lines if lines else 0.0


def label_of(row: Mapping[str, Any]) -> str:
    """A result row's workload label (a row written before workloads existed: its rate's)."""
    label = row.get("workload")
    return label if isinstance(label, str) else Workload("perturb", row["rate"]).label


def changed_text(row: Mapping[str, Any]) -> str:
    """A result row's measured ``changed_fraction`` as a percentage; blank when absent."""
    fraction = row.get("changed_fraction")
    return "" if fraction is None else f"{fraction * 100:.3g}%"
