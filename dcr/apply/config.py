"""Receiver settings: the placeholder scheme of transforming paths and :class:`ApplyConfig`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dcr.errors import ConfigError

__all__ = ["ApplyConfig", "PlaceholderScheme"]


class PlaceholderScheme(enum.Enum):
    """How inactive positions are told apart on transforming paths (paper App. A.2)."""

    NAN = "nan"
    """One loader pass with NaN at inactive positions; items holding a NaN value fall back to
    :attr:`TWO_PASS` automatically, since NaN cannot mark them."""
    TWO_PASS = "two-pass"
    """Always two passes: actives 0.0 / inactives NaN gives the mask, the real values give the
    written bits.  Also covers transforms that may map an active value to NaN."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyConfig:
    """Receiver settings.

    ``post_apply_checks`` (default off) re-reads every written position (paper App. A.2).
    ``placeholder`` (default NaN, the paper's default) picks the scheme for transforming paths.
    ``scratch_device`` (default: the device of the loader's first parameter) places the
    scratch buffer.  ``threads`` (default: the CPUs the process may run on -- its affinity
    mask -- at most 8) bounds the cores one apply writes with.  ``huge_pages`` (default on)
    backs resident storages in host memory with transparent huge pages at prewarm, where the
    kernel allows (:mod:`dcr.apply.pages`): scattered writes then miss the TLB far less often.
    """

    post_apply_checks: bool = False
    placeholder: PlaceholderScheme = PlaceholderScheme.NAN
    scratch_device: str | None = None
    threads: int | None = None
    huge_pages: bool = True

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(
                f"ApplyConfig.threads must be a positive int or None, got {self.threads!r}"
            )
