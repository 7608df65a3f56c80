"""The relay tree behind an emulated cross-cluster link (``RelayConfig.link_gbps``): owners
pace what they send to the root, the root paces what it receives from them (so every owner
shares the root's link), forwarding inside the tree is not paced, and the transport's
contract -- the conformance suite, stops while data waits for the link -- holds unchanged.
Elapsed times are only checked from below: pacing sleeps, so it can never be faster."""

from __future__ import annotations

import time
from dataclasses import replace

import anyio
import pytest
from test_transport_relay import CONFIG, RelayHarness

from dcr.adapters.transport.relay import RelayConfig, RelayNode, RelayTransport, start_tree
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.testing.transport import TransportHarness, TransportTests

pytestmark = pytest.mark.anyio

LINK = replace(CONFIG, link_gbps=0.02)
"""2.5 MB/s: the suite's 32 KiB payloads wait for the link after the first few."""
MB = 10**6


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _key(attempt: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=attempt, owner=owner, payload_id=pid)


class TestRelayBehindALink(TransportTests):
    def make_harness(self) -> TransportHarness:
        return RelayHarness("tree3", LINK)

    def check_world(self, harness: TransportHarness) -> None:
        assert isinstance(harness, RelayHarness)
        for node in harness.nodes.values():
            assert not node.drops, f"{node.name} dropped frames: {node.drops}"
        ingress = harness.nodes["n0"].ingress.stats().bytes
        assert ingress == harness.nodes["n0"].stats().cross_bytes
        assert all(n.ingress.stats().bytes == 0 for k, n in harness.nodes.items() if k != "n0")


def test_link_rate_is_checked() -> None:
    with pytest.raises(ConfigError):
        RelayConfig(link_gbps=-1.0)
    assert RelayTransport(config=RelayConfig()).uplink.bytes_per_s is None
    assert RelayTransport(config=RelayConfig(link_gbps=8.0)).uplink.bytes_per_s == 1e9


async def _tree_with_receiver(
    tg: anyio.abc.TaskGroup, config: RelayConfig
) -> tuple[dict[str, RelayNode], RelayTransport]:
    nodes = await start_tree(tg, ["root", "leaf"], fanout=1, config=config)
    rx = RelayTransport(node=nodes["leaf"].address, config=config)
    deliveries = rx.subscribe("r0")

    async def take() -> None:
        async for d in deliveries:
            await rx.taken("r0", d.key)

    tg.start_soon(take)
    probe = RelayTransport(root=nodes["root"].address, config=config)
    try:
        deadline = time.monotonic() + 10
        while "r0" not in (await probe.tree_status()).receivers:
            assert time.monotonic() < deadline, "the receiver did not reach the root"
            await anyio.sleep(0.02)
    finally:
        await probe.aclose()
    return nodes, rx


async def test_owners_share_the_roots_link() -> None:
    """Two owners send 0.5 MB each at 8 MB/s per link: each uplink carries its own bytes,
    the root's link carries both, so the sends take at least 1 MB of link time; the leaf
    forwards without a limit."""
    config = RelayConfig(link_gbps=0.064, max_payload_bytes=1 << 20)
    per_owner, size = 500_000, 100_000
    async with anyio.create_task_group() as tg:
        nodes, rx = await _tree_with_receiver(tg, config)
        root = nodes["root"]
        leaf = nodes["leaf"]
        owners = [RelayTransport(root=root.address, config=config) for _ in range(2)]
        try:
            t0 = time.monotonic()
            async with anyio.create_task_group() as sends:
                for i, owner in enumerate(owners):

                    async def send_all(owner: RelayTransport = owner, name: str = f"o{i}") -> None:
                        for pid in range(per_owner // size):
                            await owner.send(_key(1, name, pid), bytes(size))

                    sends.start_soon(send_all)
            elapsed = time.monotonic() - t0
            link = root.ingress
            assert link.bytes_per_s == 8 * MB
            assert elapsed >= 2 * per_owner / link.bytes_per_s - link.burst_s
            assert link.stats().bytes == 2 * per_owner and link.stats().waited_s > 0
            assert [o.uplink.stats().bytes for o in owners] == [per_owner, per_owner]
            assert leaf.ingress.stats().bytes == 0
            assert root.stats().cross_bytes == 2 * per_owner
        finally:
            for owner in owners:
                await owner.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()


async def test_a_send_stopped_while_its_data_waits_for_the_link_releases_the_root() -> None:
    """A payload of 4 s of link time: the attempt is stopped while the owner paces it; the
    send fails as stopped, the stop completes, the root holds nothing and takes new
    payloads."""
    config = RelayConfig(link_gbps=0.008, max_payload_bytes=8 << 20)
    async with anyio.create_task_group() as tg:
        nodes, rx = await _tree_with_receiver(tg, config)
        root = nodes["root"]
        owner = RelayTransport(root=root.address, config=config)
        control = RelayTransport(root=root.address, config=config)
        try:
            failure: list[BaseException] = []

            async def send_big() -> None:
                try:
                    await owner.send(_key(1, "o0", 0), bytes(4 * MB))
                except TransportError as exc:
                    failure.append(exc)

            async with anyio.create_task_group() as inner:
                inner.start_soon(send_big)
                deadline = time.monotonic() + 10
                while owner.uplink.stats().bytes == 0:
                    assert time.monotonic() < deadline, "the send never reached the link"
                    await anyio.sleep(0.01)
                with anyio.fail_after(10):
                    await control.stop_and_wait(1)
            assert failure and isinstance(failure[0], TransportError)
            assert failure[0].check == "stopped"
            await control.cleanup(1)
            held = root.held()
            assert held.count == 0 and held.bytes == 0
            with anyio.fail_after(10):
                await owner.send(_key(2, "o0", 0), bytes(1000))
        finally:
            await owner.aclose()
            await control.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()
