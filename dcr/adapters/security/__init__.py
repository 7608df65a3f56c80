"""Who may speak on a fleet's sockets and how its payloads are sealed: key directories
(:mod:`~dcr.adapters.security.keys`, ``dcr keys``), a process's policy
(:mod:`~dcr.adapters.security.policy`) and CURVE on ZeroMQ sockets
(:mod:`~dcr.adapters.security.curve`, loaded on first use).  docs/security.md is the threat
model."""

from typing import Any

from dcr.adapters.security.keys import COORDINATOR, ROLES, Identity, KeyDir, Keyring
from dcr.adapters.security.policy import Security, check_bind, is_loopback

__all__ = [
    "CONTROL",
    "COORDINATOR",
    "RELAY",
    "ROLES",
    "Identity",
    "KeyDir",
    "Keyring",
    "Security",
    "auth_counts",
    "check_bind",
    "is_loopback",
    "peer_identity",
]

_CURVE = {"CONTROL", "RELAY", "auth_counts", "peer_identity"}


def __getattr__(name: str) -> Any:
    if name in _CURVE:
        from dcr.adapters.security import curve

        return getattr(curve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
