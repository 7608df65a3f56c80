"""A whole fleet on Ray, run to its last version: what ``dcr fleet`` does with processes,
done with actors.

:class:`RayRun` starts the fleet's own roles (:class:`~dcr.ray.fleet.RayFleet`), one actor
per receiver pinned to its rollout node (for an ``[[engine]]``, one vLLM engine actor on the
rollout node of its receivers, its workers the receivers), and one actor per trainer rank on
the trainer nodes.  It follows the roles' events as the process launcher does (bit-for-bit checks of
every receiver against the synthetic trainer's versions, lockstep, the report) and strikes
planned faults with ``ray.kill``: a coordinator, relay node or receiver is restarted by Ray
(``max_restarts``) and recovers by itself; a killed trainer rank takes its group down, and
the run restarts the whole group at the committed version, as torch.distributed stacks do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dcr.errors import DcrError
from dcr.fleet.config import FleetConfig
from dcr.fleet.progress import FleetProgress
from dcr.ray.actors import EngineActor, ReceiverActor, TrainerActor
from dcr.ray.fleet import RayFleet, require_ray

__all__ = ["RayRun"]

_RUN_DIR_MARKER = ".dcr-run-dir"


class RayRun(FleetProgress):
    """Run the fleet ``cfg`` on the Ray cluster this driver is connected to; ``options`` are
    the launcher's (``faults``, ``say``, ``deadline_s``, ``watch``)."""

    def __init__(self, cfg: FleetConfig, **options: Any) -> None:
        super().__init__(cfg, **options)
        self.procs = {}
        self.fleet = RayFleet(cfg)
        self.resolved = cfg
        self.receivers: dict[str, Any] = {}
        """Receiver -> the actor hosting it (a receiver actor, or its engine's actor)."""
        self.engines: dict[str, Any] = {}
        self.ranks: list[Any] = []
        self._ends: dict[Any, Any] = {}
        """A trainer rank's ``join`` call -> the rank (ready: the rank ended)."""
        self._store: Any = None
        self._cfg_ref: Any = None
        self.lost: dict[str, str] = {}
        """Receiver -> the rollout node it was lost with (its Ray node died)."""
        self._nodes_checked = 0.0
        self.trainer_starts = 0

    # -- starting ------------------------------------------------------------------------------

    def start(self) -> None:
        ray = require_ray()
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / _RUN_DIR_MARKER).write_text("made by dcr.ray\n")
        (cfg.run_dir / "logs").mkdir(exist_ok=True)
        self._write_faults()
        self.resolved = self.fleet.start()
        resolved = self._cfg_ref = self.fleet.put(self.resolved)
        placement = self.fleet.placement
        assert placement is not None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        def on(node: str, name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
            return {
                "name": self.fleet.name(name),
                "namespace": cfg.ray.namespace,
                "num_cpus": 0,
                "max_restarts": cfg.ray.max_restarts,
                "max_task_retries": cfg.ray.max_restarts,
                "max_concurrency": 4,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(
                    placement.rollout[node], soft=False
                ),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            }

        for node in cfg.rollout:
            for r in node.receivers:
                engine = cfg.engine_of(r.name)
                if engine is None:
                    self.receivers[r.name] = (
                        ray.remote(ReceiverActor).options(**on(node.name, r.name))
                        .remote(resolved, r.name)
                    )  # fmt: skip
                elif engine.name not in self.engines:
                    self.engines[engine.name] = (
                        ray.remote(EngineActor)
                        .options(**on(node.name, f"engine-{engine.name}", engine.env))
                        .remote(resolved, engine.name, self.fleet.directory,
                                placement.ips[placement.rollout[node.name]])
                    )  # fmt: skip
                if engine is not None:
                    self.receivers[r.name] = self.engines[engine.name]
        self._start_trainer()
        self.say(
            f"started the fleet on Ray: {len(self.receivers)} receivers "
            f"({len(self.engines)} in vLLM engines), {len(self.ranks)} trainer ranks"
        )

    def _start_trainer(self) -> None:
        """(Re)start every trainer rank around a fresh rendezvous store held here."""
        ray = require_ray()
        from dcr.fleet.trainer import rendezvous_store

        cfg = self.cfg
        self._store = rendezvous_store(cfg.host, cfg.world_size + 1)
        env = {"GLOO_SOCKET_IFNAME": "lo"} if cfg.host.startswith("127.") else {}
        self.ranks = [
            ray.remote(TrainerActor)
            .options(
                name=self.fleet.name(f"rank-{rank}-{self.trainer_starts}"),
                namespace=cfg.ray.namespace,
                num_cpus=1,
                resources={cfg.ray.trainer: 0.001},
                max_restarts=0,
                max_concurrency=4,
                runtime_env={"env_vars": env},
            )
            .remote(self._cfg_ref, rank, int(self._store.port))
            for rank in range(cfg.world_size)
        ]
        self._ends = {actor.join.remote(): rank for rank, actor in enumerate(self.ranks)}
        self.trainer_starts += 1

    # -- faults and supervision ----------------------------------------------------------------

    def _actor(self, name: str) -> tuple[Any, bool]:
        """The actor hosting ``name`` and whether Ray restarts it (a trainer rank: no)."""
        if name.startswith("relay-"):
            return self.fleet.relays[name.removeprefix("relay-")], True
        if name in self.fleet.coordinators:
            return self.fleet.coordinators[name], True
        if name in self.receivers:
            return self.receivers[name], True
        if name in self.cfg.owners:
            return self.ranks[self.cfg.owners.index(name)], False
        raise DcrError(f"no actor of the fleet is named {name!r}")

    def kill(self, name: str, version: int, *, down_s: float = 0.0) -> None:
        """Kill the actor hosting ``name`` now (a planned fault during the refit to
        ``version``): Ray restarts it, or (a trainer rank) the run restarts the group."""
        ray = require_ray()
        actor, restarted = self._actor(name)
        ray.kill(actor, no_restart=not restarted)
        engine = self.cfg.engine_of(name)
        self.kills.append((version, f"engine-{engine.name}" if engine is not None else name))
        self._row(version).killed.append(name)
        self.say(f"ray.kill {name} during refit {version}")

    def expected_receivers(self) -> set[str]:
        """Receivers still expected to report: those of rollout nodes that are alive."""
        return super().expected_receivers() - set(self.lost)

    def _watch_nodes(self) -> None:
        """A rollout node whose Ray node died takes its relay node and receivers with it:
        the fleet goes on without them (the coordinator stops waiting for them)."""
        ray = require_ray()
        now = time.monotonic()
        if now - self._nodes_checked < 1.0 or self.fleet.placement is None:
            return
        self._nodes_checked = now
        dead = {str(n["NodeID"]) for n in ray.nodes() if not n.get("Alive", False)}
        for node in self.cfg.rollout:
            if self.fleet.placement.rollout.get(node.name) not in dead:
                continue
            gone = [r.name for r in node.receivers if r.name not in self.lost]
            for name in gone:
                self.lost[name] = node.name
            if gone:
                self.say(f"rollout node {node.name} lost (its Ray node died): the fleet goes "
                         f"on without {', '.join(gone)}")  # fmt: skip
                # The coordinator lets them depart now, not ``depart_after_s`` later; a
                # coordinator that was lost too learns it from its control link instead.
                for actor in self.fleet.coordinators.values():
                    actor.depart.remote(gone)

    def _supervise(self) -> None:
        ray = require_ray()
        self._watch_nodes()
        ready, _ = ray.wait(list(self._ends), num_returns=len(self._ends), timeout=0)
        died = False
        for ref in ready:
            self._ends.pop(ref)
            try:
                failure = ray.get(ref)
            except Exception as exc:  # the actor died (killed, or its process crashed)
                failure = f"{type(exc).__name__}"
            if failure is not None:
                died = True
        if died:
            self.say("a trainer rank ended: restarting the whole trainer at the committed version")
            for actor in self.ranks:
                ray.kill(actor, no_restart=True)
            self._start_trainer()

    # -- the run -------------------------------------------------------------------------------

    def run(self, *, before_stop: Callable[[], None] | None = None) -> dict[str, Any]:
        """Start the fleet, run it to the last version, stop it; returns the report.
        ``before_stop`` runs once the last version is checked, while the fleet still runs
        (reading an engine's digest, say)."""
        t0 = time.monotonic()
        self.start()
        try:
            self.follow(t0)
            if before_stop is not None:
                before_stop()
        finally:
            self.stop()
        report = self.report(time.monotonic() - t0)
        report["lost"] = dict(self.lost)
        return report

    def stop(self) -> None:
        """Kill every actor of the run (restarts off) and close the rendezvous store."""
        try:
            import ray
        except ImportError:
            return
        # An engine's actor hosts several receivers: each actor once.
        hosted = [a for n, a in self.receivers.items() if self.cfg.engine_of(n) is None]
        for actor in [*self.ranks, *hosted, *self.engines.values()]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                continue
        self.ranks, self.receivers, self.engines, self._ends = [], {}, {}, {}
        self.fleet.stop()
        self._store = None
