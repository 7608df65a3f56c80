"""Payloads addressed by name (a dense refit) on the relay tree: the root holds one whose
receiver has not subscribed yet until it does (its subscription may still be on its way up
the tree), and lets it through to nobody only once ``peer_timeout_s`` passed without it."""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest

from dcr.adapters.transport.relay import RelayConfig, RelayTransport, start_tree
from dcr.protocol.types import PayloadKey

pytestmark = pytest.mark.anyio

CONFIG = RelayConfig(
    max_buffered=4, max_buffered_bytes=128 << 10, receiver_window=2,
    ping_interval_s=0.1, peer_timeout_s=2.0, max_payload_bytes=4 << 20,
)  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _key(pid: int) -> PayloadKey:
    return PayloadKey(attempt=1, owner="o0", payload_id=pid)


async def test_a_payload_for_a_receiver_not_subscribed_yet_waits_for_it() -> None:
    """The owner sends first; the receiver subscribes at a leaf node afterwards: both of
    its payloads reach it, in order, and the owner's sends complete only then."""
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        nodes = await start_tree(tg, ["n0", "n1"], fanout=2, config=CONFIG)
        owner = RelayTransport(root=nodes["n0"].address, config=CONFIG)
        late = RelayTransport(node=nodes["n1"].address, config=CONFIG)
        for t in (owner, late):
            stack.push_async_callback(t.aclose)
        sent: list[PayloadKey] = []

        async def send() -> None:
            for pid in range(2):
                await owner.send(_key(pid), b"p%d" % pid, to=frozenset({"late"}))
                sent.append(_key(pid))

        tg.start_soon(send)
        await anyio.sleep(0.5)
        assert sent == [] and nodes["n0"].receivers() == frozenset()
        got: list[PayloadKey] = []
        with anyio.fail_after(10):
            async for d in late.subscribe("late"):
                got.append(d.key)
                assert d.addressed
                await late.taken("late", d.key)
                if len(got) == 2:
                    break
        assert got == [_key(0), _key(1)]
        with anyio.fail_after(10):
            while len(sent) < 2:
                await anyio.sleep(0.02)


async def test_a_payload_for_a_receiver_that_never_subscribes_is_let_through_in_the_end() -> None:
    """Held while the receiver may still come (a send never waits forever for a name that
    is gone); an empty set names nobody and is not held at all."""
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        nodes = await start_tree(tg, ["n0"], fanout=2, config=CONFIG)
        owner = RelayTransport(root=nodes["n0"].address, config=CONFIG)
        stack.push_async_callback(owner.aclose)
        done = anyio.Event()

        async def send() -> None:
            await owner.send(_key(0), b"p", to=frozenset({"ghost"}))
            done.set()

        tg.start_soon(send)
        await anyio.sleep(CONFIG.peer_timeout_s / 4)
        assert not done.is_set()  # held: "ghost" may still subscribe
        with anyio.fail_after(10 * CONFIG.peer_timeout_s):
            await done.wait()
        with anyio.fail_after(10 * CONFIG.peer_timeout_s):
            await owner.send(_key(1), b"q", to=frozenset())
