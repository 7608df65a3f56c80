"""``dcr relay``: one relay node of the tree (paper App. B "Transports", relay tree).

The first rollout node of the fleet file is the root: owners send to it.  Every other node
hangs below its parent in a balanced tree of the configured fan-out; receivers connect to the
node of their rollout host.  The root reports what crossed into the tree (V_cross, V_payload)
as ``relay`` events.
"""

from __future__ import annotations

import anyio

from dcr.adapters.transport.relay import RelayConfig, RelayNode, balanced_tree
from dcr.fleet.config import FleetConfig
from dcr.fleet.eventlog import EventLog
from dcr.fleet.runtime import _options

__all__ = ["run_relay"]


async def run_relay(cfg: FleetConfig, node: str) -> None:
    """Serve relay node ``node`` until cancelled."""
    opts = {k: v for k, v in cfg.transport.items() if k not in ("kind", "fanout")}
    tree = balanced_tree([n.name for n in cfg.rollout], int(cfg.transport.get("fanout", 2)))
    if node not in tree:
        raise SystemExit(f"the fleet file names no rollout node {node!r}")
    parent = tree[node]
    # Its port: the fleet file's, the launcher's choice, or (started by hand with port = 0)
    # any free one, recorded for the processes of this host.
    chosen = next(n.port for n in cfg.rollout if n.name == node) or cfg.recorded_ports().get(
        node, 0
    )
    relay = RelayNode(
        node,
        bind=f"tcp://{cfg.host}:{chosen}",
        parent=cfg.address(parent) if parent is not None else None,
        config=_options(RelayConfig, opts, "transport"),
    )
    log = EventLog(cfg.events_dir, f"relay-{node}")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(relay.serve)
            if not chosen:
                cfg.record_port(node, int(relay.address.rsplit(":", 1)[1]))
            log.emit("started", role="relay", node=node, parent=parent, address=relay.address)
            reported: dict[int, tuple[int, int]] = {}
            last_state: dict[str, object] = {}
            while True:
                if parent is None:  # the root reports what crossed into the tree, per attempt
                    now = relay.attempt_traffic()
                    changed = {a: t for a, t in now.items() if reported.get(a) != t}
                    if changed:
                        log.emit("traffic", attempts={str(a): list(t) for a, t in changed.items()})
                        reported.update(changed)
                held = relay.held()
                state: dict[str, object] = {
                    "held": held.count,
                    "held_bytes": held.bytes,
                    "receivers": sorted(relay.receivers()),
                    "peers_lost": relay.peers_lost,
                    "drops": dict(relay.drops),
                }
                if state != last_state:  # what an operator watches: buffers, peers, drops
                    log.emit("state", **state)
                    last_state = state
                await anyio.sleep(0.25)
    finally:
        log.close()
