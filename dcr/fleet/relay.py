"""``dcr relay``: one relay node of the tree (paper App. B "Transports", relay tree).

The first rollout node of the fleet file is the root: owners send to it.  Every other node
hangs below its parent in a balanced tree of the configured fan-out; receivers connect to the
node of their rollout host.  With the fleet's keys (``[fleet] keys``) the node is
``relay:<node>``: its ROUTER admits only keyring members and learns each peer's role from its
key, and its link to its parent checks the parent's key.  Its bounds are ``[transport]``'s
:class:`~dcr.adapters.transport.relay.RelayConfig` fields; the largest payload it takes, unless
set, follows from the fleet's catalog and bucket size (:func:`relay_config`).  The root reports
what crossed into the tree (V_cross, V_payload) as ``relay`` events.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from dcr.adapters.transport.relay import RelayConfig, RelayNode, balanced_tree
from dcr.adapters.transport.relay.sizing import largest_payload
from dcr.errors import ConfigError, DcrError
from dcr.fleet.config import FleetConfig
from dcr.fleet.eventlog import EventLog, install_metrics
from dcr.fleet.runtime import _options

__all__ = ["payload_bound", "relay_config", "run_relay"]

log = logging.getLogger(__name__)


def payload_bound(cfg: FleetConfig) -> int | None:
    """The largest payload the fleet's owners can produce (:func:`largest_payload` of its
    catalog, ``[trainer] bucket_mb`` and ``chunk_mb``), where the fleet knows them: the
    synthetic trainer (with its training plan's largest shard) or a ``[model] checkpoint``
    (its catalog; the shards are the trainer's own).  ``None`` for a trainer of another kind
    without a checkpoint: its catalog is its own."""
    from dcr.fleet.model import FleetModel

    trainer = cfg.trainer
    if not trainer.synthetic and cfg.model.checkpoint is None:
        return None
    model = FleetModel(cfg)
    build = model.build
    shard: int | None = None
    fan: int | None = None
    if trainer.synthetic:
        plan = model.plan
        mapped = [s for s in plan.shards if s.mapping is not None]
        shard = max([s.nbytes for s in mapped] + [t.spec.nbytes for t in plan.residual] + [0])
        fan = max(
            (len(seg.names) for s in mapped if s.mapping is not None
             for seg in s.mapping.segments()),
            default=1,
        )  # fmt: skip
    return largest_payload(
        model.wire_catalog,
        bucket_bytes=build.bucket_bytes,
        chunk_bytes=build.chunk_bytes,
        largest_shard_bytes=shard,
        fan=fan,
    )


def relay_config(cfg: FleetConfig) -> RelayConfig:
    """The relay nodes' bounds: ``[transport]``'s :class:`RelayConfig` fields, with
    ``max_payload_bytes`` from :func:`payload_bound` unless the fleet file sets it (or the
    fleet does not know its owners' catalog: then the :class:`RelayConfig` default)."""
    opts = {k: v for k, v in cfg.transport.items() if k not in ("kind", "fanout")}
    if "max_payload_bytes" not in opts:
        try:
            bound = payload_bound(cfg)
        except DcrError as exc:
            log.warning("relay: the largest payload is unknown here (%s); using the default "
                        "max_payload_bytes, or set it in [transport]", exc)  # fmt: skip
            bound = None
        if bound is not None:
            opts["max_payload_bytes"] = bound
    config: RelayConfig = _options(RelayConfig, opts, "transport")
    return config


def relay_parent(cfg: FleetConfig, node: str) -> str | None:
    """The parent of rollout node ``node`` in the fleet's balanced relay tree (``None``: the
    root); a ``ConfigError`` for a node the fleet file does not name."""
    tree = balanced_tree([n.name for n in cfg.rollout], int(cfg.transport.get("fanout", 2)))
    if node not in tree:
        raise ConfigError(f"the fleet file names no rollout node {node!r}")
    return tree[node]


async def run_relay(cfg: FleetConfig, node: str) -> None:
    """Serve relay node ``node`` until cancelled."""
    try:
        relay_parent(cfg, node)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    # Its port: the fleet file's, the launcher's choice, or (started by hand with port = 0)
    # any free one, recorded for the processes of this host.
    chosen = next(n.port for n in cfg.rollout if n.name == node) or cfg.recorded_ports().get(
        node, 0
    )

    def record(address: str) -> None:
        if not chosen:
            cfg.record_port(node, int(address.rsplit(":", 1)[1]))

    await serve_relay(cfg, node, bind=f"tcp://{cfg.host}:{chosen}", on_bound=record)


async def serve_relay(
    cfg: FleetConfig, node: str, *, bind: str, on_bound: Callable[[str], None] | None = None
) -> None:
    """Serve relay node ``node`` on ``bind`` until cancelled, its parent at the address the
    fleet knows (:meth:`FleetConfig.address`); ``on_bound`` learns the address it bound."""
    parent = relay_parent(cfg, node)
    config = relay_config(cfg)
    relay = RelayNode(
        node,
        bind=bind,
        parent=cfg.address(parent) if parent is not None else None,
        parent_name=parent,
        config=config,
        security=cfg.security(),
    )
    log_ = EventLog(cfg.events_dir, f"relay-{node}")
    install_metrics(cfg, "relay", f"relay-{node}")  # [metrics]: its events as metrics
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(relay.serve)
            if on_bound is not None:
                on_bound(relay.address)
            log_.emit(
                "started", role="relay", node=node, parent=parent, address=relay.address,
                keyed=relay.security.keyed, max_payload_bytes=config.max_payload_bytes,
            )  # fmt: skip
            reported: dict[int, tuple[int, int]] = {}
            last_state: dict[str, object] = {}
            while True:
                if parent is None:  # the root reports what crossed into the tree, per attempt
                    now = relay.attempt_traffic()
                    changed = {a: t for a, t in now.items() if reported.get(a) != t}
                    if changed:
                        log_.emit("traffic", attempts={str(a): list(t) for a, t in changed.items()})
                        reported.update(changed)
                held = relay.held()
                state: dict[str, object] = {
                    "held": held.count,
                    "held_bytes": held.bytes,
                    "receivers": sorted(relay.receivers()),
                    "peers_lost": relay.peers_lost,
                    "peers_refused": dict(relay.peers_refused),
                    "grants_expired": relay.grants_expired,
                    "auth": dict(relay.auth()),
                    "drops": dict(relay.drops),
                }
                if state != last_state:  # what an operator watches: buffers, peers, drops
                    log_.emit("state", **state)
                    last_state = state
                await anyio.sleep(0.25)
    finally:
        log_.close()
