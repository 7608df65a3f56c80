"""The fleet's own roles as Ray actors on a four-node cluster: placement checked before
anything starts, the relay tree formed across the rollout nodes, and Ray's restarts of a
killed relay node and coordinator recovering as in the process fleet."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from conftest import ray_fleet

from dcr.adapters.security import COORDINATOR, Identity
from dcr.errors import ConfigError, DcrError
from dcr.fleet.config import FleetConfig
from dcr.fleet.runtime import make_transport
from dcr.fleet.sections import RolloutNode
from dcr.ray import RayFleet, fleet_config, plan

DEADLINE_S = 120.0


def _until(what: str, check: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _events(cfg: FleetConfig, who: str) -> list[dict[str, object]]:
    path = cfg.events_dir / f"{who}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_placement_that_cannot_be_satisfied_fails_before_anything_starts(
    cluster: object, tmp_path: Path
) -> None:
    import ray

    cfg = ray_fleet(tmp_path)
    three = dataclasses.replace(
        cfg, rollout=(*cfg.rollout, RolloutNode(name="node2", receivers=()))
    )
    with pytest.raises(ConfigError, match="'rollout'"):
        RayFleet(three).start()
    unlabelled = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, trainer="gpu-box"))
    with pytest.raises(ConfigError, match="'gpu-box'"):
        RayFleet(unlabelled).start()
    assert not ray.util.list_named_actors(all_namespaces=True)
    with pytest.raises(ConfigError, match="no dcr fleet 'nothing'"):
        fleet_config("nothing", timeout_s=1)
    # The plan itself: each rollout node on its own node carrying "rollout".
    placement = plan(cfg, ray.nodes())
    assert len(set(placement.rollout.values())) == len(cfg.rollout) == 2


def test_a_relay_node_that_cannot_start_fails_the_fleet_closed(
    cluster: object, tmp_path: Path
) -> None:
    """The root's port is taken: its actor fails, Ray restarts it within its budget, then
    the start fails with an error naming the node, and no actor of the fleet is left."""
    import socket

    import ray

    cfg = ray_fleet(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        root = dataclasses.replace(cfg.rollout[0], port=taken.getsockname()[1])
        cfg = dataclasses.replace(
            cfg, rollout=(root, *cfg.rollout[1:]), ray=dataclasses.replace(cfg.ray, max_restarts=1)
        )
        with pytest.raises(DcrError, match=r"relay node node0 did not start.*in use"):
            RayFleet(cfg).start()
    assert not ray.util.list_named_actors(all_namespaces=True)


def test_relay_nodes_and_coordinators_recover_through_ray_restarts(
    cluster: object, tmp_path: Path
) -> None:
    import ray

    cfg = ray_fleet(tmp_path)
    fleet = RayFleet(cfg)
    try:
        resolved = fleet.start()
        # What a trainer or rollout actor of the user's finds by the fleet's name.
        found = fleet_config(cfg.name, namespace=cfg.ray.namespace)
        assert found.relay_addresses == resolved.relay_addresses == fleet.addresses
        assert found.rollout == cfg.rollout and found.owners == cfg.owners
        placement = fleet.placement
        assert placement is not None
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        for node, node_id in placement.rollout.items():
            assert nodes[node_id]["Resources"].get("rollout", 0) > 0, node
        # A receiver of the leaf node subscribes there; the root sees it through the tree.
        anyio.run(_subscribe_and_watch, resolved, fleet)
        _until("an active coordinator", lambda: _active(cfg) is not None)
        first = _active(cfg)
        assert first is not None
        ray.kill(fleet.coordinators[first[0]], no_restart=False)
        _until(
            "a coordinator of a newer epoch",
            lambda: (a := _active(cfg)) is not None and a[1] > first[1],
        )
    finally:
        fleet.stop()
    assert not ray.util.list_named_actors(all_namespaces=True)


def _active(cfg: FleetConfig) -> tuple[str, int] | None:
    """The coordinator that went active last, and its epoch."""
    latest: tuple[float, str, int] | None = None
    for who in ("coordinator", "coordinator-1"):
        for e in _events(cfg, who):
            if e["event"] == "active":
                t, epoch = float(e["t"]), int(e["epoch"])  # type: ignore[arg-type]
                if latest is None or t > latest[0]:
                    latest = (t, who, epoch)
    return None if latest is None else (latest[1], latest[2])


async def _subscribe_and_watch(cfg: FleetConfig, fleet: RayFleet) -> None:
    """r1 subscribes at node1 (a leaf): the root lists it.  node1's actor, then the root's,
    are killed and restarted by Ray at the same address; each time the root lists r1 again
    without r1 doing anything."""
    import ray

    control = make_transport(cfg, identity=COORDINATOR)
    receiver = make_transport(cfg, node="node1", identity=Identity("receiver", "r1"))
    root = next(n.name for n in cfg.rollout)

    async def seen(want: bool) -> None:
        with anyio.fail_after(DEADLINE_S):
            while True:
                try:
                    with anyio.fail_after(5):
                        status = await control.tree_status()  # type: ignore[attr-defined]
                    if ("r1" in status.receivers) == want:
                        return
                except (TimeoutError, Exception):
                    pass  # the root is restarting
                await anyio.sleep(0.2)

    async def take() -> None:
        async for d in receiver.subscribe("r1"):
            await receiver.taken("r1", d.key)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await seen(True)
            for node in ("node1", root):
                actor = fleet.relays[node]
                pid = await anyio.to_thread.run_sync(lambda a=actor: ray.get(a.pid.remote()))
                ray.kill(actor, no_restart=False)
                after = await anyio.to_thread.run_sync(
                    lambda a=actor: ray.get(a.address.remote(), timeout=DEADLINE_S)
                )
                assert after == fleet.addresses[node], node  # bound where it was
                now = await anyio.to_thread.run_sync(lambda a=actor: ray.get(a.pid.remote()))
                assert now != pid, node  # a new process: Ray restarted it
                await seen(True)
            tg.cancel_scope.cancel()
    finally:
        await receiver.aclose()
        await control.aclose()
