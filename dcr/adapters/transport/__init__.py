"""Transports: how payload bytes travel from owners to receivers."""

from dcr.adapters.transport.base import Delivery as Delivery
from dcr.adapters.transport.base import Transport as Transport
from dcr.adapters.transport.base import TransportStats as TransportStats
from dcr.adapters.transport.memory import MemoryTransport as MemoryTransport

__all__ = ["Delivery", "MemoryTransport", "Transport", "TransportStats"]
