"""Who may speak on a fleet's sockets and how its payloads are sealed: key directories
(:mod:`~dcr.adapters.security.keys`, ``dcr keys``) and CURVE on ZeroMQ sockets
(:mod:`~dcr.adapters.security.curve`).  docs/security.md is the threat model."""

from dcr.adapters.security.curve import (
    CONTROL,
    RELAY,
    Security,
    auth_counts,
    check_bind,
    is_loopback,
    peer_identity,
)
from dcr.adapters.security.keys import COORDINATOR, ROLES, Identity, KeyDir, Keyring

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
