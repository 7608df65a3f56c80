"""Training-side sources: shards plus the mapping metadata that projects them.

:class:`~dcr.adapters.sources.megatron.MegatronSource` (Megatron-Core through Megatron-Bridge)
and :class:`~dcr.adapters.sources.fsdp.FsdpSource` (FSDP2 / DTensor) read a distributed
trainer's own shards, one process per rank; import them from their modules.
"""

from dcr.adapters.sources.base import ShardSource as ShardSource
from dcr.adapters.sources.base import Source as Source
from dcr.adapters.sources.state_dict import StateDictSource as StateDictSource

__all__ = ["ShardSource", "Source", "StateDictSource"]
