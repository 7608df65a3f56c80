"""The relay-tree transport (paper §7.1, App. B "Transports", App. C Fig. C.1 ``RelayTree``).

Owners stream payloads over ZeroMQ DEALER/ROUTER sockets to one root relay node on the rollout
side, which forwards them over a balanced tree of :class:`RelayNode`\\ s; each node hands them
to the receivers it hosts, and queueing ACKs flow back up.  :class:`RelayTransport` is what one
process uses.  Run ``python -m dcr.adapters.transport.relay node|receiver ...`` to host a relay
node or a stand-alone receiver in a process of its own.

With the fleet's keys every relay socket is CURVE and a peer's role and name come from its key
(``sockets``, ``node``); every node holds each peer to bounds (``guard``, :class:`RelayConfig`).

The modules: ``config`` (:class:`RelayConfig`, the tree's bounds and shape), ``sizing`` (the
largest payload an owner can produce, :func:`largest_payload`), ``frames`` (the relay frame
codec), ``sockets`` (ZeroMQ socket helpers, who a peer is), ``client`` (:class:`RelayTransport`,
over ``rootclient``, the connection to the root, and ``subscription``, a receiver's subscription
at its node), ``node`` (:class:`RelayNode`, over ``state``, ``forwarding``, ``grants`` and
``guard``) and ``processes`` (``python -m``).
"""

from dcr.adapters.transport.relay.client import (
    RelayTransport,
    TreeStatus,
    open_relay_transport,
)
from dcr.adapters.transport.relay.config import Held, RelayConfig, balanced_tree
from dcr.adapters.transport.relay.node import RelayNode, start_tree
from dcr.adapters.transport.relay.processes import main
from dcr.adapters.transport.relay.sizing import largest_payload

__all__ = [
    "Held",
    "RelayConfig",
    "RelayNode",
    "RelayTransport",
    "TreeStatus",
    "balanced_tree",
    "largest_payload",
    "main",
    "open_relay_transport",
    "start_tree",
]
