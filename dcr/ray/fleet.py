"""A fleet's own roles on a Ray cluster: :class:`RayFleet` places them and starts them.

``RayFleet(cfg).start()`` (on a driver connected to the cluster with ``ray.init``) checks the
placement first (:func:`~dcr.ray.placement.plan`: nothing starts when it cannot be
satisfied), then starts the directory, one relay node per rollout node (root first, each
pinned to its Ray node and bound to that node's IP), and the coordinators.  Each actor
declares ``[ray] max_restarts``: Ray restarts what dies, and the role recovers as in the
process fleet.  ``stop()`` kills every actor it started, restarts off.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any

from dcr.adapters.transport.relay import balanced_tree
from dcr.errors import ConfigError, DcrError
from dcr.fleet.config import FleetConfig
from dcr.fleet.runtime import relayed
from dcr.ray.actors import BIND_WAIT_S, CoordinatorActor, Directory, RelayActor
from dcr.ray.placement import Placement, plan

__all__ = ["RayFleet", "engine_url", "fleet_config", "require_ray"]


def require_ray(*, connected: bool = True) -> Any:
    """The ``ray`` module, or a clear error saying how to install it (or, ``connected``, that
    this process must connect to a cluster first)."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("dcr.ray needs Ray: pip install 'dcr[ray]'") from exc
    if connected and not ray.is_initialized():
        raise ConfigError("connect to the Ray cluster first (ray.init(address=...))")
    return ray


class RayFleet:
    """The coordinators and relay nodes of the fleet ``cfg`` as Ray actors."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.placement: Placement | None = None
        self.directory: Any = None
        self.relays: dict[str, Any] = {}
        self.coordinators: dict[str, Any] = {}
        self.addresses: dict[str, str] = {}
        self.refs: list[Any] = []
        """Object refs of the actors' constructor arguments, held while the actors live: Ray
        needs them again to restart an actor."""

    def put(self, value: Any) -> Any:
        """``value`` in Ray's object store, referenced for as long as this fleet runs."""
        ray = require_ray()
        ref = ray.put(value)
        self.refs.append(ref)
        return ref

    def name(self, role: str) -> str:
        """The Ray name of one of the fleet's actors (in namespace ``[ray] namespace``)."""
        return f"dcr-{self.cfg.name}-{role}"

    def start(self) -> FleetConfig:
        """Place and start the fleet's actors; returns the fleet config as every other role
        should use it (with the relay nodes' addresses)."""
        ray = require_ray()
        self.placement = placement = plan(self.cfg, ray.nodes())
        try:
            self._start(ray, placement)
        except BaseException:
            self.stop()
            raise
        return replace(self.cfg, relay_addresses=dict(self.addresses))

    def _start(self, ray: Any, placement: Placement) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg, ns, restarts = self.cfg, self.cfg.ray.namespace, self.cfg.ray.max_restarts
        self.directory = (
            ray.remote(Directory)
            .options(name=self.name("directory"), namespace=ns, max_restarts=-1, num_cpus=0)
            .remote()
        )
        for node in _tree_order(cfg) if relayed(cfg) else ():  # object storage: no tree
            node_id = placement.rollout[node]
            actor = (
                ray.remote(RelayActor)
                .options(
                    name=self.name(f"relay-{node}"),
                    namespace=ns,
                    num_cpus=0,
                    max_restarts=restarts,
                    max_task_retries=restarts,  # its methods only read: safe to repeat
                    max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote(self.put(cfg), node, placement.ips[node_id], self.directory)
            )
            self.relays[node] = actor
            try:
                # Each of its starts may wait for the bind (and for a loaded machine).
                wait_s = (restarts + 1) * 2 * BIND_WAIT_S
                self.addresses[node] = ray.get(actor.address.remote(), timeout=wait_s)
            except Exception as exc:
                raise DcrError(f"relay node {node} did not start on Ray: {_cause(exc)}") from exc
        resolved = self.put(replace(cfg, relay_addresses=dict(self.addresses)))
        ray.get(self.directory.set_config.remote(resolved))
        for i in range(cfg.ray.coordinators):
            name = "coordinator" if i == 0 else f"coordinator-{i}"
            self.coordinators[name] = (
                ray.remote(CoordinatorActor)
                .options(
                    name=self.name(name),
                    namespace=ns,
                    num_cpus=0,
                    scheduling_strategy="SPREAD",  # one lost node takes at most one of them
                    max_restarts=restarts,
                    max_task_retries=restarts,  # its methods only read: safe to repeat
                    max_concurrency=4,
                )
                .remote(resolved, name)
            )
        for name, actor in self.coordinators.items():
            try:
                ray.get(actor.alive.remote(), timeout=BIND_WAIT_S)
            except Exception as exc:
                raise DcrError(f"{name} did not start on Ray: {_cause(exc)}") from exc

    def stop(self) -> None:
        """Kill every actor this fleet started (Ray restarts none of them)."""
        try:
            import ray
        except ImportError:
            return
        actors = [*self.coordinators.values(), *self.relays.values(), self.directory]
        for actor in actors:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already gone
                    continue
        self.coordinators.clear()
        self.relays.clear()
        self.directory = None
        self.refs.clear()


def fleet_config(fleet: str, *, namespace: str = "dcr", timeout_s: float = 60.0) -> FleetConfig:
    """The config of fleet ``fleet`` (its ``[fleet] name``) that a :class:`RayFleet` started
    in ``namespace``, relay addresses included: what a trainer worker or rollout actor of
    your own passes to :func:`dcr.join_trainer` instead of a fleet file on a shared disk."""
    ray = require_ray()
    name = f"dcr-{fleet}-directory"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            directory = ray.get_actor(name, namespace=namespace)
            cfg = ray.get(directory.config.remote(), timeout=timeout_s)
        except ValueError:  # not started (yet)
            cfg = None
        if cfg is not None:
            return cfg  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise ConfigError(
                f"no dcr fleet {fleet!r} runs in Ray namespace {namespace!r} "
                f"(no actor {name!r} with a config within {timeout_s:g} s)"
            )
        time.sleep(0.2)


def engine_url(fleet: str, engine: str, *, namespace: str = "dcr") -> str | None:
    """The URL the vLLM engine actor ``engine`` of fleet ``fleet`` serves on (``None`` while it
    does not serve: not started yet, or being restarted)."""
    ray = require_ray()
    try:
        directory = ray.get_actor(f"dcr-{fleet}-directory", namespace=namespace)
        url = ray.get(directory.engine.remote(engine), timeout=30.0)
    except (ValueError, ray.exceptions.RayError):  # no directory (yet), or it is restarting
        return None
    return None if url is None else str(url)


def _cause(exc: BaseException) -> str:
    """What an actor's failure says, without Ray's traceback (the actor's log has it)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''} (the actor's log says why)"


def _tree_order(cfg: FleetConfig) -> list[str]:
    """The fleet's rollout nodes, every parent before its children."""
    tree = balanced_tree([n.name for n in cfg.rollout], int(cfg.transport.get("fanout", 2)))
    children: dict[str | None, list[str]] = {}
    for node, parent in tree.items():
        children.setdefault(parent, []).append(node)
    order: list[str] = []
    todo = deque(children.get(None, []))
    while todo:
        node = todo.popleft()
        order.append(node)
        todo.extend(children.get(node, []))
    return order
