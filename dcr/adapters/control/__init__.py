"""Control channels: coordinator -> endpoint calls and endpoint -> coordinator replies."""

from dcr.adapters.control.base import ControlChannel as ControlChannel
from dcr.adapters.control.base import CoordinatorLink as CoordinatorLink
from dcr.adapters.control.base import EndpointLink as EndpointLink
from dcr.adapters.control.memory import MemoryControl as MemoryControl

__all__ = ["ControlChannel", "CoordinatorLink", "EndpointLink", "MemoryControl"]
