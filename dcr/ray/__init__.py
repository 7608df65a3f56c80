"""dcr on Ray: the fleet's roles as Ray actors (``pip install 'dcr[ray]'``).

:class:`RayFleet` starts the coordinators and relay nodes of a fleet as actors pinned to the
cluster's nodes (``[ray]`` in the fleet file: which custom resource marks trainer and rollout
nodes) and lets Ray restart them; :func:`plan` checks a placement before anything starts;
:class:`RayRun` runs a whole fleet (receivers, vLLM engines and trainer ranks too).  Neither
importing this package nor ``python -m dcr.ray.netns`` imports Ray, ZeroMQ or torch: the names
below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcr.ray.fleet import RayFleet as RayFleet
    from dcr.ray.fleet import fleet_config as fleet_config
    from dcr.ray.fleet import require_ray as require_ray
    from dcr.ray.placement import Placement as Placement
    from dcr.ray.placement import plan as plan
    from dcr.ray.run import RayRun as RayRun

_EXPORTS = {
    "RayFleet": "dcr.ray.fleet",
    "fleet_config": "dcr.ray.fleet",
    "require_ray": "dcr.ray.fleet",
    "Placement": "dcr.ray.placement",
    "plan": "dcr.ray.placement",
    "RayRun": "dcr.ray.run",
}

__all__ = ["Placement", "RayFleet", "RayRun", "fleet_config", "plan", "require_ray"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dcr.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
