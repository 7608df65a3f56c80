"""``spool``: the object-storage transport over a spool directory of the plugin's own choice.

A third party's transport: the object-store protocol of dcr over dcr's directory backend,
configured from the fleet file by the plugin itself -- ``spool`` (relative to the fleet file;
default ``<run_dir>/spool``), ``durable`` (fsync each object), and the object-store
settings; ``node_cache`` follows dcr's rule for per-node shared downloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from dcr.adapters.context import AdapterContext, dataclass_options
from dcr.adapters.transport.directory import DirectoryBackend
from dcr.adapters.transport.objstore import (
    ObjectStoreConfig,
    ObjectStoreTransport,
    fleet_settings,
)
from dcr.errors import ConfigError

__all__ = ["SpoolTransport"]


class SpoolTransport(ObjectStoreTransport):
    """Payload objects as files under a spool directory."""

    def __init__(self, spool: str, *, durable: bool, config: ObjectStoreConfig) -> None:
        super().__init__(DirectoryBackend(spool, fsync=durable), config)
        self.spool = spool
        self.built_for: str | None = None
        """The rollout node the fleet file built this transport for."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        opts = fleet_settings(options, context, own=("spool", "durable"))
        spool = opts.pop("spool", None)
        root = context.path(spool) if spool is not None else context.run_dir / "spool"
        durable = opts.pop("durable", False)
        if not isinstance(durable, bool):
            raise ConfigError(f"[{context.section}]: durable must be true or false")
        transport = cls(
            str(root), durable=durable, config=dataclass_options(ObjectStoreConfig, opts,
                                                                 context.section)
        )  # fmt: skip
        transport.built_for = context.node
        return transport
