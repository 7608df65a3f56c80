"""Training-side sources: shards plus the mapping metadata that projects them."""

from dcr.adapters.sources.base import ShardSource as ShardSource
from dcr.adapters.sources.base import Source as Source
from dcr.adapters.sources.state_dict import StateDictSource as StateDictSource

__all__ = ["ShardSource", "Source", "StateDictSource"]
