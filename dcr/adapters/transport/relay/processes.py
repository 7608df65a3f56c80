"""Relay nodes and receivers in processes of their own: ``python -m
dcr.adapters.transport.relay node|receiver ...`` hosts one relay node, or one stand-alone
receiver that takes every delivery (the relay-tree transport's tests kill them with SIGKILL).
With ``--keys DIR`` every socket is CURVE with the key directory's key pairs (a node is
``relay:<name>``, a receiver ``receiver:<name>``), and the names of the nodes connected to are
needed (``--parent-name``, ``--node-name``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import anyio

from dcr.adapters.security import KeyDir, Security
from dcr.adapters.transport.relay.client import open_relay_transport
from dcr.adapters.transport.relay.config import RelayConfig
from dcr.adapters.transport.relay.node import RelayNode

__all__ = ["main"]


async def _run_node(args: argparse.Namespace, config: RelayConfig, security: Security) -> None:
    node = RelayNode(
        args.name, bind=args.bind, parent=args.parent, parent_name=args.parent_name,
        config=config, security=security,
    )  # fmt: skip
    with anyio.move_on_after(args.lifetime):
        async with anyio.create_task_group() as tg:
            await tg.start(node.serve)
            print(f"READY {node.address}", flush=True)


async def _run_receiver(args: argparse.Namespace, config: RelayConfig, security: Security) -> None:
    async with open_relay_transport(
        node=args.node, config=config, security=security, node_name=args.node_name
    ) as transport:
        with anyio.move_on_after(args.lifetime):
            print("READY", flush=True)
            async for d in transport.subscribe(args.name):
                if args.delay:
                    await anyio.sleep(args.delay)
                await transport.taken(args.name, d.key)
                print(f"GOT {d.key.attempt} {d.key.owner} {d.key.payload_id}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dcr.adapters.transport.relay node|receiver ...``: one relay node, or one
    receiver that takes every delivery, in a process of its own (bounded by ``--lifetime``)."""
    parser = argparse.ArgumentParser(prog="python -m dcr.adapters.transport.relay")
    parser.add_argument("--lifetime", type=float, default=3600.0, help="exit after this many s")
    parser.add_argument("--ping", type=float, default=0.25, help="ping interval, s")
    parser.add_argument("--timeout", type=float, default=3.0, help="peer timeout, s")
    parser.add_argument("--keys", default=None, help="key directory: CURVE on every socket")
    sub = parser.add_subparsers(dest="role", required=True)
    node = sub.add_parser("node", help="serve one relay node")
    node.add_argument("--name", required=True)
    node.add_argument("--bind", default="tcp://127.0.0.1:0")
    node.add_argument("--parent", default=None, help="parent address; omit for the root")
    node.add_argument("--parent-name", default=None, help="the parent's name (with --keys)")
    rx = sub.add_parser("receiver", help="subscribe one receiver that takes every delivery")
    rx.add_argument("--name", required=True)
    rx.add_argument("--node", required=True, help="address of the hosting relay node")
    rx.add_argument("--node-name", default=None, help="its name (with --keys)")
    rx.add_argument("--delay", type=float, default=0.0, help="seconds before taking each one")
    args = parser.parse_args(argv)
    config = RelayConfig(ping_interval_s=args.ping, peer_timeout_s=args.timeout)
    security = Security(KeyDir(args.keys) if args.keys else None)
    run = _run_node if args.role == "node" else _run_receiver
    anyio.run(run, args, config, security, backend="asyncio")
