"""dcr on Ray: the fleet's roles as Ray actors (``pip install 'dcr[ray]'``).

:class:`RayFleet` starts the coordinators and relay nodes of a fleet as actors pinned to the
cluster's nodes (``[ray]`` in the fleet file: which custom resource marks trainer and rollout
nodes) and lets Ray restart them; :func:`plan` checks a placement before anything starts.
Importing this package does not import Ray.
"""

from __future__ import annotations

from dcr.ray.fleet import RayFleet, fleet_config, require_ray
from dcr.ray.placement import Placement, plan
from dcr.ray.run import RayRun

__all__ = ["Placement", "RayFleet", "RayRun", "fleet_config", "plan", "require_ray"]
