"""Relay-tree throughput on loopback, against raw ZeroMQ (paper §8.7: relay-tree transport
dominates refit latency, so its throughput bounds the refit's).

:func:`relay_throughput` measures, in one run: (a) one DEALER streaming ``count`` messages of
``size`` bytes to one ROUTER that acknowledges the last, and (b) owners sending ``count``
payloads of ``size`` bytes through a root and a balanced tree of relay nodes to receivers that
take each delivery at once, counted as payload bytes delivered per second at each receiver.
Everything runs in the calling event loop (asyncio), on 127.0.0.1, so the tree's links share
one thread: :func:`tree_hops` counts the link transfers each payload makes (owner to root, the
tree edges down to the receivers' nodes, node to receiver), and ``link_ratio`` compares the
bytes all links moved per second with the raw rate.  With ``keys`` the same run measures the
tree a second time with a temporary key directory, CURVE (authentication and encryption) on
every relay socket, right after the plain one, so both see the same machine load.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.security import Identity, KeyDir, Security
from dcr.adapters.transport.relay import RelayConfig, RelayTransport, balanced_tree, start_tree
from dcr.errors import ConfigError
from dcr.protocol.types import PayloadKey

__all__ = [
    "bench_keys",
    "raw_zmq_throughput",
    "relay_throughput",
    "relay_tree_throughput",
    "tree_hops",
]


async def raw_zmq_throughput(*, count: int = 64, size: int = 4 << 20) -> float:
    """Bytes per second of ``count`` messages of ``size`` bytes from a DEALER to a ROUTER,
    timed until the ROUTER's acknowledgement of the last one arrives."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for sock in (router, dealer):
            sock.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        await dealer.send(b"hello")
        ident, _ = await router.recv_multipart()
        payload = os.urandom(size)

        async def sink() -> None:
            for _ in range(count):
                await router.recv_multipart(copy=False)
            await router.send_multipart([ident, b"ack"])

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sink)
            for i in range(count):
                await dealer.send_multipart([i.to_bytes(8, "big"), payload], copy=False)
            await dealer.recv()
        return count * size / (time.perf_counter() - t0)
    finally:
        router.close()
        dealer.close()
        ctx.term()


def _hosts(names: list[str], receivers: int) -> list[str]:
    """The node of each receiver: spread over the non-root nodes (the root with one node)."""
    hosts = names[1:] or names
    return [hosts[i % len(hosts)] for i in range(receivers)]


def tree_hops(*, nodes: int, fanout: int, receivers: int) -> int:
    """Link transfers per payload in :func:`relay_tree_throughput`'s tree: owner to root,
    each tree edge on a path from the root to a receiver's node, and node to receiver."""
    names = [f"n{i}" for i in range(nodes)]
    parent = balanced_tree(names, fanout)
    edges: set[str] = set()
    for host in _hosts(names, receivers):
        node: str | None = host
        while node is not None and parent[node] is not None:
            edges.add(node)
            node = parent[node]
    return 1 + len(edges) + receivers


async def relay_tree_throughput(
    *,
    count: int = 64,
    size: int = 4 << 20,
    nodes: int = 3,
    fanout: int = 2,
    receivers: int = 2,
    owners: int = 1,
    inflight: int = 4,
    config: RelayConfig | None = None,
    security: Security | None = None,
) -> list[float]:
    """Payload bytes per second delivered at each receiver, from the first send to that
    receiver's last arrival; receivers are spread over the non-root nodes.  With
    ``security`` keys (:func:`bench_keys`) every relay socket is CURVE."""
    if min(count, size, nodes, receivers, owners, inflight) < 1:
        raise ConfigError("relay benchmark sizes and counts must be at least 1")
    config = config or RelayConfig(max_payload_bytes=max(size, 1 << 20))
    payload = os.urandom(size)
    per_owner = [count // owners + (1 if i < count % owners else 0) for i in range(owners)]
    async with anyio.create_task_group() as tg:
        names = [f"n{i}" for i in range(nodes)]
        tree = await start_tree(tg, names, fanout=fanout, config=config, security=security)
        rx = [
            RelayTransport(
                node=tree[host].address, node_name=host, config=config, security=security
            )
            for host in _hosts(names, receivers)
        ]
        tx = [
            RelayTransport(
                root=tree[names[0]].address, root_name=names[0], config=config,
                security=security, identity=Identity("owner", f"o{o}"),
            )
            for o in range(owners)
        ]  # fmt: skip
        last: dict[str, float] = {}
        got: dict[str, int] = {}
        try:

            async def take(name: str, t: RelayTransport) -> None:
                got[name] = 0
                async for d in t.subscribe(name):
                    await t.taken(name, d.key)
                    got[name] += len(d.data)
                    last[name] = time.perf_counter()

            for i, t in enumerate(rx):
                tg.start_soon(take, f"r{i}", t)
            with anyio.fail_after(10):
                while len((await tx[0].tree_status()).receivers) < receivers:
                    await anyio.sleep(0.01)

            async def stream(o: int) -> None:
                window = anyio.Semaphore(inflight)

                async def one(pid: int) -> None:
                    try:
                        key = PayloadKey(attempt=1, owner=f"o{o}", payload_id=pid)
                        await tx[o].send(key, payload)
                    finally:
                        window.release()

                async with anyio.create_task_group() as sends:
                    for pid in range(per_owner[o]):
                        await window.acquire()
                        sends.start_soon(one, pid)

            t0 = time.perf_counter()
            async with anyio.create_task_group() as senders:
                for o in range(owners):
                    senders.start_soon(stream, o)
            total = count * size
            with anyio.fail_after(60):
                while any(got.get(f"r{i}", 0) < total for i in range(receivers)):
                    await anyio.sleep(0.005)
            rates = [total / (last[f"r{i}"] - t0) for i in range(receivers)]
        finally:
            with anyio.CancelScope(shield=True):
                for t in [*tx, *rx]:
                    await t.aclose()
            tg.cancel_scope.cancel()
    return rates


def bench_keys(path: Path, *, nodes: int, receivers: int, owners: int) -> KeyDir:
    """A key directory at ``path`` for :func:`relay_tree_throughput`'s tree: relay nodes
    ``n0..``, owners ``o0..``, receivers ``r0..``."""
    identities = [Identity("relay", f"n{i}") for i in range(nodes)]
    identities += [Identity("owner", f"o{i}") for i in range(owners)]
    identities += [Identity("receiver", f"r{i}") for i in range(receivers)]
    return KeyDir.init(path, identities)


async def relay_throughput(
    *,
    count: int = 64,
    size: int = 4 << 20,
    nodes: int = 3,
    fanout: int = 2,
    receivers: int = 2,
    owners: int = 1,
    inflight: int = 4,
    keys: bool = False,
) -> dict[str, float]:
    """Raw ZeroMQ vs relay-tree throughput on loopback, in bytes per second, and their ratio.

    ``relay_bytes_per_s`` is the mean over receivers of the payload bytes each received per
    second; ``relay_min_bytes_per_s`` the slowest receiver's; ``link_ratio`` is
    ``hops * relay_bytes_per_s / raw_bytes_per_s`` (every link shares this one thread).  With
    ``keys`` the tree is measured again with CURVE on every relay socket, right after:
    ``keyed_bytes_per_s``, ``keyed_min_bytes_per_s`` and ``keyed_ratio`` (keyed / plain).
    """

    async def tree(security: Security | None = None) -> list[float]:
        return await relay_tree_throughput(
            count=count, size=size, nodes=nodes, fanout=fanout, receivers=receivers,
            owners=owners, inflight=inflight, security=security,
        )  # fmt: skip

    raw = await raw_zmq_throughput(count=count, size=size)
    per_receiver = await tree()
    relay = sum(per_receiver) / len(per_receiver)
    hops = tree_hops(nodes=nodes, fanout=fanout, receivers=receivers)
    keyed: dict[str, float] = {}
    if keys:
        with tempfile.TemporaryDirectory(prefix="dcr-bench-keys-") as tmp:
            security = Security(
                bench_keys(Path(tmp) / "keys", nodes=nodes, receivers=receivers, owners=owners)
            )
            secured = await tree(security)
        rate = sum(secured) / len(secured)
        keyed = {
            "keyed_bytes_per_s": rate,
            "keyed_min_bytes_per_s": min(secured),
            "keyed_ratio": rate / relay,
        }
    return {
        "count": float(count),
        "size": float(size),
        "nodes": float(nodes),
        "receivers": float(receivers),
        "owners": float(owners),
        "raw_bytes_per_s": raw,
        "relay_bytes_per_s": relay,
        "relay_min_bytes_per_s": min(per_receiver),
        "ratio": relay / raw,
        "hops": float(hops),
        "link_ratio": hops * relay / raw,
        **keyed,
    }
