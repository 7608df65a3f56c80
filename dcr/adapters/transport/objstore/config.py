"""Settings of the object-storage transport: :class:`ObjectStoreConfig` and how a fleet
file's transport section becomes them for one process (:func:`fleet_settings`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from dcr.adapters.context import known_options
from dcr.errors import ConfigError
from dcr.wire.seal import seal_keys

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["ObjectStoreConfig", "fleet_settings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectStoreConfig:
    """Settings of the object-storage transport; every field has a default.

    ``arrival_grace_s`` is the transport's promise to receivers (the arrival check at flush):
    how long after its owner's send returned a payload may take to reach them -- one
    ``poll_s`` plus the fetch itself, and behind a slow link, the payloads queued before it.
    Raise it when payloads are large for the link.
    """

    poll_s: float = 0.1
    """How often a node lists the manifests while it has subscribed receivers."""
    fetch_concurrency: int = 4
    """GETs a node runs at once."""
    receiver_window: int = 8
    """Deliveries a receiver holds without taking them before its node stops fetching for it
    (bounds a node's memory: at most ``fetch_concurrency + window`` payloads per receiver)."""
    arrival_grace_s: float = 30.0
    link_gbps: float | None = None
    """Emulated per-process link rate, each direction (``None``: unlimited)."""
    retries: int = 6
    """Tries of one storage operation before its error surfaces."""
    backoff_s: float = 0.05
    """First backoff between tries; it doubles each try (full jitter)."""
    backoff_max_s: float = 2.0
    max_payload_bytes: int = 1 << 34
    """Largest payload sent or fetched (a manifest entry above it is refused)."""
    tombstone_ttl_s: float = 3600.0
    """How long a stopped attempt's tombstone refuses late senders."""
    cleanup_timeout_s: float = 60.0
    """Bound on a cleanup (and on writing a tombstone), which finishes even when its caller
    is cancelled."""
    node_cache: str | None = None
    """A directory the receiver processes of one rollout node share (local disk or tmpfs):
    each payload is then downloaded once per node, not once per process
    (:mod:`~dcr.adapters.transport.nodeshare`).  ``None``: every process downloads."""
    fleet_secret: bytes | None = field(default=None, repr=False)
    """The fleet's 32-byte secret (never in a fleet file: read it from the fleet's key
    directory): manifest entries are written sealed with its manifest key and a node ignores
    any entry whose seal does not verify (:mod:`~dcr.adapters.transport.objstore.layout`).
    ``None``: entries are plain JSON.  Every process of a fleet sets it, or none does."""

    @property
    def manifest_seal_key(self) -> bytes | None:
        """The key that seals manifest entries (:func:`dcr.wire.seal.seal_keys`), if any."""
        return None if self.fleet_secret is None else seal_keys(self.fleet_secret).manifest

    def __post_init__(self) -> None:
        checks = {
            "poll_s": self.poll_s > 0,
            "fetch_concurrency": self.fetch_concurrency >= 1,
            "receiver_window": self.receiver_window >= 1,
            "arrival_grace_s": self.arrival_grace_s >= 0,
            "link_gbps": self.link_gbps is None or self.link_gbps >= 0,
            "retries": self.retries >= 1,
            "backoff_s": 0 <= self.backoff_s <= self.backoff_max_s,
            "max_payload_bytes": self.max_payload_bytes >= 1,
            "tombstone_ttl_s": self.tombstone_ttl_s >= 0,
            "cleanup_timeout_s": self.cleanup_timeout_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(f"invalid object-store transport settings: {', '.join(bad)}")
        if self.fleet_secret is not None:
            seal_keys(self.fleet_secret)  # a ConfigError unless 32 bytes


SEALERS = frozenset({"owner", "receiver"})
"""The roles whose transports seal or check manifest entries (they hold the fleet secret)."""


def fleet_settings(
    options: Mapping[str, Any], context: AdapterContext, *, own: Iterable[str] = ()
) -> dict[str, Any]:
    """The keys of a fleet file's object-store transport section, for one process.

    ``own`` are the backend's keys (a bucket, a path); the others are
    :class:`ObjectStoreConfig` fields but ``fleet_secret`` (a secret is no fleet-file
    setting), and any other key raises :class:`~dcr.errors.ConfigError`.  ``node_cache``
    becomes this process's node directory: in a process hosting receivers of rollout node
    ``N``, ``<node_cache>/N`` (relative to the fleet file), or ``<run_dir>/fetches/N`` without
    one where ``N`` hosts several receivers, so their processes download each payload once;
    elsewhere (owners, the coordinator) nothing, since only receivers fetch.  With the fleet's
    keys, an owner's or a receiver's transport gets the fleet secret: manifest entries are
    sealed and checked.
    """
    known = {*own, *(f.name for f in fields(ObjectStoreConfig) if f.name != "fleet_secret")}
    opts = known_options(options, known, context.section)
    shared = opts.pop("node_cache", None)
    if context.node is not None and (shared is not None or context.node_receivers > 1):
        base = context.path(shared) if shared is not None else context.run_dir / "fetches"
        opts["node_cache"] = str(base / context.node)
    keys = context.security.keys
    if keys is not None and context.identity is not None and context.identity.role in SEALERS:
        opts["fleet_secret"] = keys.secret()  # owners seal manifest entries, receivers check
    return opts
