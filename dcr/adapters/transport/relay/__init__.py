"""The relay-tree transport (paper §7.1, App. B "Transports", App. C Fig. C.1 ``RelayTree``).

Owners stream payloads over ZeroMQ DEALER/ROUTER sockets to one root relay node on the rollout
side, which forwards them over a balanced tree of :class:`RelayNode`\\ s; each node hands them
to the receivers it hosts, and queueing ACKs flow back up.  :class:`RelayTransport` is what one
process uses.  Run ``python -m dcr.adapters.transport.relay node|receiver ...`` to host a relay
node or a stand-alone receiver in a process of its own.

The modules: ``config`` (:class:`RelayConfig`, the tree's shape), ``frames`` (the relay frame
codec), ``sockets`` (ZeroMQ socket helpers), ``client`` (:class:`RelayTransport`, over
``rootclient``, the connection to the root, and ``subscription``, a receiver's subscription at
its node), ``node`` (:class:`RelayNode`, over ``state``, ``forwarding`` and ``grants``) and
``processes`` (``python -m``).
"""

from dcr.adapters.transport.relay.client import (
    RelayTransport,
    TreeStatus,
    open_relay_transport,
)
from dcr.adapters.transport.relay.config import Held, RelayConfig, balanced_tree
from dcr.adapters.transport.relay.node import RelayNode, start_tree
from dcr.adapters.transport.relay.processes import main

__all__ = [
    "Held",
    "RelayConfig",
    "RelayNode",
    "RelayTransport",
    "TreeStatus",
    "balanced_tree",
    "main",
    "open_relay_transport",
    "start_tree",
]
