"""Per-request weight versions: which committed version produced which output tokens.

The engine labels its weights with the commit record they hold (vLLM's weight version, set
while generation is paused, just before it resumes), and vLLM reports on every finished
request the contiguous spans of output tokens that each label produced.  A request that
straddles a refit -- frozen in flight while the gate was closed, resumed on the new weights --
reports two spans, and the first token of the second span is where the weights changed.

An engine outside any fleet (a reference engine) labels its weights the same way, with
:func:`dense_record` of the checkpoint version it loaded in full, so a run that refits by
deltas and a run that reloads full checkpoints report comparable versions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dcr.errors import ConfigError
from dcr.protocol.types import CommitRecord

__all__ = ["UNCONFIRMED", "WeightSpan", "dense_record", "label_of", "record_of", "weight_spans"]

_PREFIX = "dcr:"

UNCONFIRMED = "unconfirmed"
"""The weight-version label of weights no record describes (a dense load that failed after
it began writing); requests report version ``None`` for the tokens they produced."""


def label_of(record: CommitRecord) -> str:
    """The engine's weight-version label of a commit record: ``dcr:<version>:<candidate>``."""
    return f"{_PREFIX}{record.version}:{record.candidate}"


def dense_record(version: int) -> CommitRecord:
    """The record of weights loaded in full from the checkpoint of ``version`` by an engine
    outside any fleet: candidate ``dense-<version>`` (no commit store names one)."""
    if type(version) is not int or version < 0:
        raise ConfigError(f"a checkpoint version must be a non-negative integer, got {version!r}")
    return CommitRecord(version=version, candidate=f"dense-{version}")


def record_of(label: str) -> CommitRecord | None:
    """The commit record a label names, or ``None`` for a label dcr did not set (the weights
    the engine started with before a receiver confirmed them)."""
    if not label.startswith(_PREFIX):
        return None
    version, sep, candidate = label[len(_PREFIX) :].partition(":")
    if not sep or not version.isdigit() or not candidate:
        raise ConfigError(f"malformed weight-version label {label!r}", check="weight-version")
    return CommitRecord(version=int(version), candidate=candidate)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightSpan:
    """Output tokens ``[start, end)`` of a request were generated with committed ``record``
    (``None``: with weights no receiver had confirmed, e.g. before the engine joined)."""

    record: CommitRecord | None
    start: int
    end: int

    @property
    def version(self) -> int | None:
        return None if self.record is None else self.record.version

    @property
    def candidate(self) -> str | None:
        return None if self.record is None else self.record.candidate

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "candidate": self.candidate,
            "start": self.start,
            "end": self.end,
        }


def weight_spans(completion: Any) -> tuple[WeightSpan, ...]:
    """The weight spans of a finished vLLM ``CompletionOutput`` (``output.outputs[i]``).

    Empty when the request produced no token.  Raises :class:`ConfigError` for an
    unfinished output, which carries no spans yet.
    """
    spans: Iterable[Any] | None = getattr(completion, "weight_versions", None)
    if spans is None:
        if not getattr(completion, "token_ids", None):
            return ()
        raise ConfigError(
            "the output carries no weight versions: vLLM reports them on finished requests",
            check="weight-version",
        )
    return tuple(
        WeightSpan(record=record_of(str(s.version)), start=int(s.start), end=int(s.end))
        for s in spans
    )
