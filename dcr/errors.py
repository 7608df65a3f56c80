"""One exception tree for dcr.

Errors say whose fault it was (the h11 habit): :class:`LocalProtocolError` means this
process broke the protocol or was misconfigured, :class:`RemoteProtocolError` means a peer or a
payload did.  Every message names the attempt, the tensor and the check that failed where they
are known.  Expected outcomes such as a lost compare-and-set are results, not exceptions.
"""

from __future__ import annotations

__all__ = [
    "AttemptObsolete",
    "CheckpointError",
    "CommitConflict",
    "CommitStoreError",
    "ConfigError",
    "ControlMessageRejected",
    "DcrError",
    "LayoutError",
    "LoaderConditionViolated",
    "LoaderPathUnsupported",
    "LocalProtocolError",
    "PayloadRejected",
    "ProtocolError",
    "RemoteProtocolError",
    "TransportError",
]


def _context(attempt: int | None, tensor: str | None, check: str | None) -> str:
    parts = []
    if attempt is not None:
        parts.append(f"attempt={attempt}")
    if tensor is not None:
        parts.append(f"tensor={tensor!r}")
    if check is not None:
        parts.append(f"check={check}")
    return f" [{', '.join(parts)}]" if parts else ""


class DcrError(Exception):
    """Base class of every error raised by dcr.

    ``attempt``, ``tensor`` and ``check`` say where the failure happened; any of them may be
    ``None`` when it does not apply.
    """

    def __init__(
        self,
        message: str,
        *,
        attempt: int | None = None,
        tensor: str | None = None,
        check: str | None = None,
    ) -> None:
        self.message = message
        self.attempt = attempt
        self.tensor = tensor
        self.check = check
        super().__init__(message + _context(attempt, tensor, check))


class ConfigError(DcrError):
    """A configuration value is invalid (raised before anything runs)."""


class LayoutError(ConfigError):
    """A training or serving layout cannot be built from the given tensors and config."""


class CheckpointError(ConfigError):
    """A checkpoint directory cannot give a catalog (:mod:`dcr.catalog`).

    ``check`` names what is wrong: ``missing`` (a file or directory), ``truncated`` (a file
    shorter than its header says), ``header`` (a malformed safetensors header), ``index`` (a
    malformed or inconsistent ``model.safetensors.index.json``), ``config`` (a malformed
    ``config.json``) or ``dtype`` (a tensor of a dtype dcr does not carry).
    """


class ProtocolError(DcrError):
    """The refit protocol was broken; see the two subclasses for whose fault it was."""


class LocalProtocolError(ProtocolError):
    """This process tried something the protocol forbids (an illegal transition, say)."""


class RemoteProtocolError(ProtocolError):
    """A peer, or bytes that a peer sent, broke the protocol."""


class PayloadRejected(RemoteProtocolError):
    """A received payload failed a check; nothing of it was applied.

    ``check`` names the failed check: ``digest``, ``magic``, ``version``, ``truncated``,
    ``oversized``, ``decompress``, ``schema``, ``bounds``, ``name``, ``shape``, ``dtype``,
    ``encoding``, ``classification`` or ``conflicting-duplicate``.
    """


class ControlMessageRejected(RemoteProtocolError):
    """A received control message failed the codec's checks and was dropped.

    ``check`` names the failed check: ``oversized``, ``truncated``, ``malformed``,
    ``version``, ``type`` or ``schema`` (see :mod:`dcr.adapters.control.codec`).
    """


class LoaderConditionViolated(RemoteProtocolError):
    """The native loader broke a loader condition while applying an item (paper App. A.2).

    Raised before the item's writes land wherever the violation can be seen before writing
    (dtype change on an XOR path, overlapping XOR ranges, unclassified writes); a write that
    bypassed the dispatch hook has already landed, so the receiver needs an overwrite retry or a
    dense refit.
    """


class LoaderPathUnsupported(LoaderConditionViolated):
    """Prewarm found a loader path that dcr cannot apply deltas through."""


class TransportError(DcrError):
    """Moving payload bytes failed; ``retryable`` says whether trying again may help."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        attempt: int | None = None,
        tensor: str | None = None,
        check: str | None = None,
    ) -> None:
        self.retryable = retryable
        super().__init__(message, attempt=attempt, tensor=tensor, check=check)


class CommitStoreError(DcrError):
    """The commit store (control plane) could not be reached or answered with an error.

    ``retryable`` says whether trying again may help.  A compare-and-set whose outcome is not
    known is not an error: it returns ``UNKNOWN`` and ``read_commit`` resolves it.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        attempt: int | None = None,
        tensor: str | None = None,
        check: str | None = None,
    ) -> None:
        self.retryable = retryable
        super().__init__(message, attempt=attempt, tensor=tensor, check=check)


class CommitConflict(ProtocolError):
    """Another coordinator committed this transition first (paper App. B.2)."""


class AttemptObsolete(ProtocolError):
    """The attempt was marked obsolete; its payloads and calls are ignored."""
