"""What the engine process sends its workers to join a fleet, and how their errors come back.

Both cross vLLM's ``collective_rpc`` as plain data (lists, strings, numbers), so neither side
depends on how vLLM serializes objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcr import errors
from dcr.errors import DcrError
from dcr.protocol.types import CommitRecord

__all__ = ["JoinSpec", "error_from_wire", "error_to_wire"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinSpec:
    """What every worker of one engine needs to join the fleet (sent by ``collective_rpc``).

    ``names[r]`` is the receiver of worker rank ``r`` in the fleet file ``fleet``; ``gate``
    the engine gate's address; ``held`` the committed record the engine's weights hold
    (``None``: restore the committed version by dense refit first); ``checkpoint`` the
    checkpoint directory whose catalog the receivers take instead of the fleet file's;
    ``report_fingerprints`` whether they report the fingerprint of every version they hold
    (for the launcher's checks); ``fleet_secret`` the fleet's 32-byte secret the receivers
    verify payload seals with (hex on the wire, to the engine's own workers only);
    ``relay_addresses`` the relay nodes' addresses where the fleet knows them from elsewhere
    than its file (a fleet on Ray: :func:`dcr.ray.fleet_config`).
    """

    fleet: str
    names: tuple[str, ...]
    gate: str
    held: CommitRecord | None = None
    apply_threads: int | None = None
    gate_timeout_s: float = 3600.0
    checkpoint: str | None = None
    report_fingerprints: bool = False
    fleet_secret: bytes | None = field(default=None, repr=False)
    relay_addresses: dict[str, str] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "fleet": self.fleet,
            "names": list(self.names),
            "gate": self.gate,
            "held": None if self.held is None else [self.held.version, self.held.candidate],
            "apply_threads": self.apply_threads,
            "gate_timeout_s": self.gate_timeout_s,
            "checkpoint": self.checkpoint,
            "report_fingerprints": self.report_fingerprints,
            "fleet_secret": None if self.fleet_secret is None else self.fleet_secret.hex(),
            "relay_addresses": dict(self.relay_addresses),
        }

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> JoinSpec:
        held = raw.get("held")
        secret = raw.get("fleet_secret")
        return cls(
            fleet=str(raw["fleet"]),
            names=tuple(str(n) for n in raw["names"]),
            gate=str(raw["gate"]),
            held=None if held is None else CommitRecord(version=int(held[0]), candidate=held[1]),
            apply_threads=raw.get("apply_threads"),
            gate_timeout_s=float(raw.get("gate_timeout_s", 3600.0)),
            checkpoint=None if raw.get("checkpoint") is None else str(raw["checkpoint"]),
            report_fingerprints=bool(raw.get("report_fingerprints", False)),
            fleet_secret=None if secret is None else bytes.fromhex(str(secret)),
            relay_addresses={
                str(k): str(v) for k, v in dict(raw.get("relay_addresses") or {}).items()
            },
        )


def error_to_wire(exc: DcrError) -> dict[str, Any]:
    """A dcr error as plain data, to cross ``collective_rpc`` and be raised again."""
    return {
        "type": type(exc).__name__,
        "message": exc.message,
        "attempt": exc.attempt,
        "tensor": exc.tensor,
        "check": exc.check,
    }


def error_from_wire(error: Mapping[str, Any], worker: int) -> DcrError:
    """The error a worker reported, as the :class:`~dcr.errors.DcrError` subclass it was."""
    cls = getattr(errors, str(error.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, DcrError)):
        cls = DcrError
    return cls(
        f"worker {worker}: {error.get('message')}",
        attempt=error.get("attempt"),
        tensor=error.get("tensor"),
        check=error.get("check"),
    )
