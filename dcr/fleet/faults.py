"""Planned faults of a fleet run (``dcr fleet --faults``, ``dcr demo --faults``): which process
is SIGKILLed at which point of which refit (:class:`Fault`), the demo's cycling plan and a
seeded random one."""

from __future__ import annotations

from dataclasses import dataclass

from dcr.fleet.config import FleetConfig

__all__ = ["Fault", "default_faults", "fault_plan", "random_faults"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """SIGKILL ``target`` mid-refit to ``version``.

    ``after`` is where: ``"applied"`` (receiver ``target`` applied a payload of that refit),
    ``"sent"`` (owner ``target`` sent one), ``"replied"`` (the active coordinator --
    ``target="coordinator"`` -- got an endpoint's reply in that refit), ``"dense"`` (a
    receiver applied a payload of the dense refit restoring ``version`` after it joined).
    The process stops at that point and reports it (:class:`~dcr.fleet.eventlog.FaultPoints`),
    so the SIGKILL lands exactly there.  A relay node (``target="relay-<node>"``) is killed
    while a receiver it hosts stops at its point (``"applied"`` or ``"dense"``): the rest of
    the refit is still in flight through that node.  ``"flip"`` kills nothing: receiver
    ``target`` flips one stored bit once it holds ``version`` (silent corruption the proof
    of the base version must catch at the next prepare).  ``down_s``: how long supervision
    leaves the killed process down before it starts it again (a relay node that stays away
    longer than the tree's ``peer_timeout_s``, say).
    """

    version: int
    target: str
    after: str = "applied"
    down_s: float = 0.0


def _relayed(cfg: FleetConfig) -> bool:
    """Whether the fleet's payloads travel through relay processes (not object storage)."""
    from dcr.fleet.runtime import relayed

    return relayed(cfg)


def default_faults(cfg: FleetConfig) -> list[Fault]:
    """The demo's plan from refit 2 on: a receiver, an owner, the active coordinator and a
    relay node (when the fleet has a relay tree), each SIGKILLed mid-refit, cycling."""
    receivers = [r.name for r in cfg.receivers]
    victim_rx = receivers[1] if len(receivers) > 1 else receivers[0]
    relay = cfg.rollout[-1].name
    plan = [
        (victim_rx, "applied"),
        (cfg.owners[min(1, len(cfg.owners) - 1)], "sent"),
        ("coordinator", "replied"),
    ]
    if _relayed(cfg):
        plan.append((f"relay-{relay}", "applied"))
    return [
        Fault(version=v, target=plan[(v - 2) % len(plan)][0], after=plan[(v - 2) % len(plan)][1])
        for v in range(2, cfg.model.refits + 1)
    ]


def random_faults(cfg: FleetConfig, seed: int, *, per_refit: int = 1) -> list[Fault]:
    """``per_refit`` SIGKILLs in every refit from 2 on, each of a role drawn at random
    (receivers, trainer ranks, the active coordinator, relay nodes), at its fault point."""
    import random

    rng = random.Random(seed)
    choices = [(r.name, "applied") for r in cfg.receivers]
    choices += [(o, "sent") for o in cfg.owners]
    choices += [("coordinator", "replied")]
    if _relayed(cfg):
        choices += [(f"relay-{n.name}", "applied") for n in cfg.rollout]
    plan = []
    for v in range(2, cfg.model.refits + 1):
        for target, after in rng.sample(choices, per_refit):
            plan.append(Fault(version=v, target=target, after=after))
    return plan


def fault_plan(cfg: FleetConfig, kind: str | None, seed: int = 0) -> list[Fault]:
    """``None``: no faults; ``"plan"``: :func:`default_faults`; ``"random"``:
    :func:`random_faults` seeded by ``seed``."""
    if kind is None:
        return []
    return default_faults(cfg) if kind == "plan" else random_faults(cfg, seed)
