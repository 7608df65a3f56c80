"""The relay-tree transport: the conformance suite on trees of 3 and 5 nodes (fan-out 2) with
receivers on several nodes, strict framing, hostile frames, and real processes killed with
SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr.adapters.registry import load
from dcr.adapters.transport.base import Transport, TransportStats, TransportWrapper
from dcr.adapters.transport.memory import MemoryTransport
from dcr.adapters.transport.relay import (
    RelayConfig,
    RelayNode,
    RelayTransport,
    balanced_tree,
    start_tree,
)
from dcr.adapters.transport.relay.frames import (
    MAGIC,
    VERSION,
    Ack,
    Answer,
    Data,
    Frame,
    FrameError,
    Grant,
    Join,
    Offer,
    Payload,
    Ping,
    Pong,
    Refused,
    Stop,
    Subscribe,
    Unsubscribe,
    decode,
    decode_header,
    encode,
)
from dcr.bench.relay import relay_throughput, tree_hops
from dcr.errors import ConfigError, TransportError
from dcr.fleet.eventlog import EventLog
from dcr.fleet.timing import report_subscription
from dcr.protocol.types import PayloadKey
from dcr.testing.transport import HeldLike, TransportHarness, TransportTests

pytestmark = pytest.mark.anyio

CONFIG = RelayConfig(
    max_buffered=4,
    max_buffered_bytes=128 << 10,
    receiver_window=2,
    ping_interval_s=0.1,
    peer_timeout_s=1.0,
    max_payload_bytes=4 << 20,
)
"""Small windows so that the suite's 32 KiB payloads exercise credit; fast liveness."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _key(attempt: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=attempt, owner=owner, payload_id=pid)


async def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.02)


SHAPES = {
    "tree3": (3, ("n1", "n2", "n0")),
    "tree5": (5, ("n3", "n4", "n2", "n1")),
}
"""Tree sizes (fan-out 2) and the nodes receivers go to in turn: with 5 nodes the first two
receivers hang below ``n1``, which is neither root nor leaf."""


class RelayHarness(TransportHarness):
    """A balanced tree (fan-out 2) rooted at ``n0``, all in this event loop on real TCP
    sockets; every owner, receiver and the coordinator has a transport of its own, as if each
    were its own process."""

    def __init__(self, shape: str = "tree3", config: RelayConfig = CONFIG) -> None:
        self.size, self.placement = SHAPES[shape]
        self.config = config
        self.nodes: dict[str, RelayNode] = {}
        self.receivers: dict[str, RelayTransport] = {}
        self._stack = AsyncExitStack()
        self._control: RelayTransport | None = None

    async def __aenter__(self) -> RelayHarness:
        tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.callback(tg.cancel_scope.cancel)
        names = [f"n{i}" for i in range(self.size)]
        self.nodes = await start_tree(tg, names, fanout=2, config=self.config)
        return self

    async def aclose(self) -> None:
        await self._stack.aclose()

    async def _transport(self, **kwargs: Any) -> RelayTransport:
        t = RelayTransport(config=self.config, **kwargs)
        self._stack.push_async_callback(t.aclose)
        return t

    @property
    def root(self) -> str:
        return self.nodes["n0"].address

    async def sender(self, owner: str) -> Transport:
        return await self._transport(root=self.root)

    async def receiver(self, name: str) -> Transport:
        node = self.nodes[self.placement[len(self.receivers) % len(self.placement)]]
        t = self.receivers[name] = await self._transport(node=node.address)
        return t

    async def controller(self) -> Transport:
        if self._control is None:
            self._control = await self._transport(root=self.root)
        return self._control

    async def vanish(self, name: str) -> None:
        await self.receivers.pop(name).aclose()

    async def settle(self, receivers: Collection[str]) -> None:
        control = await self.controller()
        assert isinstance(control, RelayTransport)
        deadline = time.monotonic() + 5
        while not set(receivers) <= (await control.tree_status()).receivers:
            assert time.monotonic() < deadline, "receivers did not reach the root"
            await anyio.sleep(0.02)

    def boundary_stats(self) -> TransportStats:
        return self.nodes["n0"].stats()

    def held(self) -> Mapping[str, HeldLike]:
        out: dict[str, HeldLike] = {name: node.held() for name, node in self.nodes.items()}
        for name, t in self.receivers.items():
            try:
                out[f"receiver {name}"] = t.held(name)
            except TransportError:
                continue  # unsubscribed
        return out


class TestRelayTransport(TransportTests):
    """The suite on trees of 3 and 5 nodes (the ``shape`` parameter)."""

    @pytest.fixture(autouse=True, params=sorted(SHAPES))
    def _shape(self, request: pytest.FixtureRequest) -> None:
        self.shape = request.param

    def make_harness(self) -> TransportHarness:
        return RelayHarness(self.shape)

    def check_world(self, harness: TransportHarness) -> None:
        assert isinstance(harness, RelayHarness)
        for node in harness.nodes.values():
            assert not node.drops, f"{node.name} dropped frames: {node.drops}"


# -- tree shape, registry, configuration ---------------------------------------------------------


def test_balanced_tree_parents() -> None:
    names = [f"n{i}" for i in range(7)]
    assert balanced_tree(names, 2) == {
        "n0": None,
        "n1": "n0",
        "n2": "n0",
        "n3": "n1",
        "n4": "n1",
        "n5": "n2",
        "n6": "n2",
    }
    assert balanced_tree(names[:4], 3)["n3"] == "n0"
    with pytest.raises(ConfigError):
        balanced_tree(names, 0)
    with pytest.raises(ConfigError):
        balanced_tree(["a", "a"], 2)


def test_relay_transport_is_registered() -> None:
    assert load("transport", "relay") is RelayTransport


def test_relay_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        RelayConfig(receiver_window=0)
    with pytest.raises(ConfigError):
        RelayConfig(ping_interval_s=2.0, peer_timeout_s=1.0)
    with pytest.raises(ConfigError):
        RelayConfig(hwm=8)


# -- framing ------------------------------------------------------------------------------------

KEY = _key(7, "owner-0", 3)
FRAMES: list[Frame] = [
    Offer(seq=1, key=KEY, size=10, to=None),
    Offer(seq=2, key=KEY, size=0, to=frozenset({"b", "a", "ü"})),
    Data(seq=1, size=3),
    Payload(origin=9, seq=4, key=KEY, size=3, to=frozenset({"r0"})),
    Ack(seq=4),
    Stop(origin=9, seq=5, attempt=-1, cleanup=True),
    Refused(seq=1, retryable=False, check="stopped", reason="no"),
    Subscribe(nonce=3, window=2, window_bytes=1 << 40, receiver="r0"),
    Unsubscribe(),
    Join(nonce=1, capacity=4, capacity_bytes=5, receivers=frozenset({"r1", "r2"})),
    Ping(nonce=2**64 - 1),
    Answer(seq=3, receivers=frozenset(), payloads=1, payload_bytes=2, cross_bytes=3),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_frames_round_trip_and_every_truncation_is_rejected(frame: Frame) -> None:
    header = encode(frame)
    assert decode_header(header) == frame
    for cut in range(len(header)):
        with pytest.raises(FrameError) as info:
            decode_header(header[:cut])
        assert info.value.check == "truncated"
    with pytest.raises(FrameError) as info:
        decode_header(header + b"\0")
    assert info.value.check == "malformed"


def test_frame_checks_name_the_reason() -> None:
    header = encode(Ack(seq=1))
    cases = {
        "magic": b"XXXX" + header[4:],
        "version": header[:4] + b"\x01" + header[5:],
        "kind": header[:5] + b"\xee" + header[6:],
    }
    for reason, data in cases.items():
        with pytest.raises(FrameError) as info:
            decode_header(data)
        assert info.value.check == reason
    data = encode(Data(seq=1, size=10))
    for rest, reason in (([], "parts"), ([b"x" * 9], "truncated"), ([b"x" * 11], "malformed")):
        with pytest.raises(FrameError) as info:
            decode(data, rest, max_size=100)
        assert info.value.check == reason
    with pytest.raises(FrameError) as info:
        decode(encode(Data(seq=1, size=1 << 40)), [b""], max_size=100)
    assert info.value.check == "oversized"
    with pytest.raises(FrameError) as info:
        decode(header, [b"body"], max_size=100)
    assert info.value.check == "parts"
    unsorted = encode(Join(nonce=1, capacity=1, capacity_bytes=1, receivers=frozenset({"a", "b"})))
    with pytest.raises(FrameError) as info:
        decode_header(unsorted.replace(b"\x01a\x00\x01b", b"\x01b\x00\x01a"))
    assert info.value.check == "malformed"
    with pytest.raises(FrameError) as info:
        encode(Ack(seq=-1))
    assert info.value.check == "encode"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_random_headers_only_raise_frame_errors(data: bytes) -> None:
    try:
        decode_header(encode(Ack(seq=1))[:6] + data)
        decode_header(data)
    except FrameError:
        pass


# -- hostile and stale frames against a live tree ----------------------------------------------


async def test_bad_frames_are_counted_drops_and_change_nothing() -> None:
    """Truncated, unknown, wrong-role, replayed, oversized and stray frames: each is a counted
    drop, no payload is accepted, and the tree then delivers as before."""
    async with RelayHarness() as h:
        root = h.nodes["n0"]
        rx = await h.receiver("r0")
        got: list[PayloadKey] = []

        async def take() -> None:
            async for d in rx.subscribe("r0"):
                got.append(d.key)
                await rx.taken("r0", d.key)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await h.settle(["r0"])
            ctx = zmq.asyncio.Context()
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.ROUTING_ID, b"c:hostile")
            raw.connect(root.address)
            node = ctx.socket(zmq.DEALER)
            node.setsockopt(zmq.LINGER, 0)
            node.setsockopt(zmq.ROUTING_ID, b"n:fake")
            node.connect(root.address)
            try:
                offer = encode(Offer(seq=5, key=_key(1, "x", 0), size=4, to=None))
                for parts in (
                    [offer[:-3]],  # truncated
                    [MAGIC + bytes([VERSION, 0x63])],  # unknown kind
                    [b"JUNK" + offer[4:]],  # magic
                    [encode(Data(seq=77, size=4)), b"abcd"],  # data nobody granted
                    [encode(Data(seq=1, size=1 << 40)), b""],  # oversized
                    [encode(Subscribe(nonce=1, window=1, window_bytes=1, receiver="x"))],  # role
                    [encode(Payload(origin=1, seq=1, key=KEY, size=1, to=None)), b"x"],  # dir.
                    [offer],
                    [offer],  # replayed request number
                    [encode(Ack(seq=123))],  # an ACK from an owner's connection
                ):
                    await raw.send_multipart(parts)
                await node.send_multipart([encode(Ack(seq=1))])  # unknown link
                await node.send_multipart(
                    [encode(Join(nonce=1, capacity=0, capacity_bytes=1, receivers=frozenset()))]
                )
                want = {
                    "truncated": 1,
                    "kind": 1,
                    "magic": 1,
                    "unknown": 2,
                    "oversized": 1,
                    "role": 2,
                    "direction": 1,
                    "replayed": 1,
                    "malformed": 1,
                }
                await _wait(lambda: sum(root.drops.values()) >= sum(want.values()), 5, "drops")
                await anyio.sleep(0.1)
                assert dict(root.drops) == want
                # The one well-formed offer holds granted room until its client has been gone
                # (silent) for peer_timeout_s.
                raw.close()
                await _wait(lambda: root.held().count == 0, 5, "released room")
                assert root.stats().payloads == 0
                owner = await h.sender("o0")
                await owner.send(_key(1, "o0", 0), b"fine")
                await _wait(lambda: got == [_key(1, "o0", 0)], 5, "delivery after garbage")
            finally:
                raw.close()
                node.close()
                ctx.term()
            tg.cancel_scope.cancel()


async def test_oversized_message_is_refused_before_allocation() -> None:
    """A message above MAXMSGSIZE drops only its sender's connection; an offer above the
    limit is refused as not retryable; the tree keeps working."""
    async with RelayHarness() as h:
        root = h.nodes["n0"]
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(root.address)
        try:
            await raw.send_multipart([encode(Data(seq=1, size=8 << 20)), bytes(8 << 20)])
            await anyio.sleep(0.2)
        finally:
            raw.close()
            ctx.term()
        owner = await h.sender("o0")
        with pytest.raises(TransportError) as info:
            await owner.send(_key(1, "o0", 0), bytes(CONFIG.max_payload_bytes + 1))
        assert info.value.check == "oversized" and info.value.retryable is False
        with anyio.fail_after(5):
            await owner.send(_key(1, "o0", 1), b"still fine")
        assert root.stats().payloads == 1


async def test_replayed_payload_frame_is_dropped_by_the_receiver() -> None:
    """A node replaying an old transfer id to a receiver: the receiver drops it."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rx = RelayTransport(node=f"tcp://127.0.0.1:{port}", config=CONFIG)
    try:
        deliveries = rx.subscribe("r0")
        with anyio.fail_after(5):
            ident, _ = await router.recv_multipart()
        frame = encode(Payload(origin=5, seq=2, key=KEY, size=1, to=None))
        for _ in range(2):
            await router.send_multipart([ident, frame, b"x"])
        later = encode(Payload(origin=5, seq=3, key=_key(7, "owner-0", 4), size=1, to=None))
        await router.send_multipart([ident, later, b"y"])
        with anyio.fail_after(5):
            first = await deliveries.__anext__()
            second = await deliveries.__anext__()
        assert (first.key, second.key) == (KEY, _key(7, "owner-0", 4))
        assert rx.held("r0").count == 2
        assert rx.drops() == {"replayed": 1}
    finally:
        await rx.aclose()
        router.close()
        ctx.term()


async def test_a_fleet_receiver_reports_what_its_subscription_dropped(tmp_path: Path) -> None:
    """``report_subscription`` (a fleet receiver's ``drops`` and ``untaken`` events): one ``drops``
    each time the counts change, none while they stay; one ``untaken`` once deliveries stayed
    untaken past the stall time, again only after the count changed; through a wrapper too;
    nothing for other transports."""
    log = EventLog(tmp_path, "r0")
    await report_subscription(MemoryTransport(), log, "r0", every_s=0.01)  # returns at once
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rx = RelayTransport(node=f"tcp://127.0.0.1:{port}", config=CONFIG)

    def events(name: str) -> list[dict[str, Any]]:
        lines = log.path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    try:
        deliveries = rx.subscribe("r0")
        async with anyio.create_task_group() as tg:
            watch = partial(report_subscription, every_s=0.01, stall_s=0.2)
            tg.start_soon(watch, TransportWrapper(rx), log, "r0")
            with anyio.fail_after(5):
                ident, _ = await router.recv_multipart()
            frame = encode(Payload(origin=5, seq=2, key=KEY, size=1, to=None))
            for _ in range(3):  # the second and third are replays
                await router.send_multipart([ident, frame, b"x"])
            with anyio.fail_after(5):
                await deliveries.__anext__()
            await _wait(lambda: rx.drops() == {"replayed": 2}, 5, "two replays dropped")
            await _wait(lambda: bool(events("untaken")), 5, "the untaken delivery reported")
            await anyio.sleep(0.3)  # many checks, nothing changed: nothing more to report
            assert [(e["count"], e["seconds"] >= 0.2) for e in events("untaken")] == [(1, True)]
            await rx.taken("r0", KEY)
            await anyio.sleep(0.1)  # checked with none untaken
            later = encode(Payload(origin=5, seq=3, key=_key(7, "owner-0", 4), size=1, to=None))
            await router.send_multipart([ident, later, b"y"])
            await _wait(lambda: len(events("untaken")) == 2, 5, "the new stall reported")
            tg.cancel_scope.cancel()
    finally:
        await rx.aclose()
        router.close()
        ctx.term()
        log.close()
    drops = [e["drops"] for e in events("drops")]
    assert drops[-1] == {"replayed": 2} and len(drops) <= 2, drops
    assert all(d in ({"replayed": 1}, {"replayed": 2}) for d in drops)
    assert [e["count"] for e in events("untaken")] == [1, 1]


async def test_v_cross_counts_every_copy_at_the_root() -> None:
    async with RelayHarness() as h:
        owner = await h.sender("o0")
        sizes = [10, 2000, 3]
        for pid, size in enumerate(sizes):
            await owner.send(_key(1, "o0", pid), bytes(size))
        root = h.nodes["n0"].stats()
        assert root.cross_bytes == root.payload_bytes == sum(sizes)
        assert owner.stats() == root
        await owner.send(_key(1, "o0", 1), bytes(2000))
        root = h.nodes["n0"].stats()
        assert root.cross_bytes == sum(sizes) + 2000 > root.payload_bytes == sum(sizes)
        control = await h.controller()
        assert isinstance(control, RelayTransport)
        assert (await control.tree_status()).stats == root


async def _serve_in(
    scope: anyio.CancelScope,
    node: RelayNode,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await node.serve(task_status=task_status)


async def _start_when_bindable(tg: anyio.abc.TaskGroup, make: Callable[[], RelayNode]) -> RelayNode:
    """Start a node at an address a closed socket held: ZeroMQ releases the port from its I/O
    thread after ``close()`` returns, so the first bind attempts may still find it in use."""
    with anyio.fail_after(10):
        while True:
            node = make()
            try:
                await tg.start(node.serve)
                return node
            except TransportError as exc:
                if exc.check != "bind":
                    raise
                await anyio.sleep(0.05)


async def test_crashed_node_is_dropped_and_its_receiver_resubscribes_after_restart() -> None:
    """A leaf node dies while a send waits on its receiver: the root drops its subtree and the
    send completes for the others; restarted at the same address, the node rejoins and its
    receiver reconnects and re-subscribes by itself."""
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        root = RelayNode("n0", config=CONFIG)
        await tg.start(root.serve)
        n1 = RelayNode("n1", parent=root.address, config=CONFIG)
        await tg.start(n1.serve)
        first_scope = anyio.CancelScope()
        n2 = RelayNode("n2", parent=root.address, config=CONFIG)
        await tg.start(_serve_in, first_scope, n2)
        transports = [RelayTransport(root=root.address, config=CONFIG)]
        transports += [RelayTransport(node=n.address, config=CONFIG) for n in (n1, n2)]
        for t in transports:
            stack.push_async_callback(t.aclose)
        owner, ra, rb = transports
        got: dict[str, list[PayloadKey]] = {"ra": [], "rb": []}
        taking = {"ra": anyio.Event(), "rb": anyio.Event()}
        taking["ra"].set()

        async def take(name: str, t: RelayTransport) -> None:
            async for d in t.subscribe(name):
                got[name].append(d.key)
                await taking[name].wait()
                await t.taken(name, d.key)

        tg.start_soon(take, "ra", ra)
        tg.start_soon(take, "rb", rb)
        await _wait(lambda: root.receivers() == {"ra", "rb"}, 5, "both receivers")
        done: list[float] = []

        async def send(pid: int) -> None:
            await owner.send(_key(1, "o0", pid), b"p")
            done.append(time.monotonic())

        tg.start_soon(send, 0)
        await _wait(lambda: got["rb"] == [_key(1, "o0", 0)], 5, "rb's first payload")
        assert not done  # rb has not taken it
        crashed = time.monotonic()
        first_scope.cancel()
        await _wait(lambda: len(done) == 1, 5, "the send after the crash")
        assert done[0] - crashed < 2.0
        assert root.receivers() == {"ra"}
        await _start_when_bindable(
            tg, lambda: RelayNode("n2", bind=n2.address, parent=root.address, config=CONFIG)
        )
        taking["rb"].set()
        await _wait(lambda: root.receivers() == {"ra", "rb"}, 5, "rb re-subscribed")
        with anyio.fail_after(5):
            await owner.send(_key(1, "o0", 1), b"q")
        assert got["rb"][-1] == _key(1, "o0", 1) and got["ra"][-1] == _key(1, "o0", 1)


async def test_pending_sends_of_a_stopped_attempt_are_refused() -> None:
    """Sends waiting on a receiver that takes nothing fail with ``check="stopped"`` once the
    coordinator stops their attempt; an owner's later send of it is refused by the root."""
    async with RelayHarness() as h:
        rx = await h.receiver("r0")
        rx.subscribe("r0")  # never read: its window fills and the sends wait
        await h.settle(["r0"])
        owner, other = await h.sender("o0"), await h.sender("o1")
        errors: list[TransportError] = []

        async def send(pid: int) -> None:
            try:
                await owner.send(_key(1, "o0", pid), bytes(100))
            except TransportError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for pid in range(3):
                tg.start_soon(send, pid)
            await _wait(lambda: rx.held("r0").count == CONFIG.receiver_window, 5, "a full window")
            control = await h.controller()
            with anyio.fail_after(5):
                await control.stop_and_wait(1)
        assert [(e.check, e.retryable, e.attempt) for e in errors] == [("stopped", False, 1)] * 3
        assert rx.held("r0").count == 0
        with pytest.raises(TransportError) as info:
            await other.send(_key(1, "o1", 0), b"late")
        assert (info.value.check, info.value.retryable) == ("stopped", False)
        assert all(node.held().count == 0 for node in h.nodes.values())


async def test_bad_addresses_are_transport_errors() -> None:
    t = RelayTransport(root="nonsense://x", node="tcp://", config=CONFIG)
    try:
        with pytest.raises(TransportError):
            await t.send(_key(1, "o", 0), b"x")
        with pytest.raises(TransportError):
            t.subscribe("r0")
        with pytest.raises(TransportError) as info:
            RelayTransport(config=CONFIG).subscribe("r0")
        assert info.value.check == "config"
    finally:
        await t.aclose()


# -- real processes -----------------------------------------------------------------------------


async def _spawn(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m dcr.adapters.transport.relay ...``; returns it and its READY line."""
    command = [sys.executable, "-m", "dcr.adapters.transport.relay"]
    command += ["--lifetime", "180", "--ping", "0.1", "--timeout", "1.0", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        with anyio.fail_after(90):  # importing torch takes 20 s on a loaded 2-core machine
            line = (
                await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
            ).strip()
    except BaseException:
        _kill(proc)
        raise
    assert line.startswith("READY"), line
    return proc, line.removeprefix("READY").strip()


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


async def test_processes_killed_with_sigkill_and_a_node_restarted() -> None:
    """Relay nodes ``n1``, ``n2`` and a slow receiver ``rp`` run as processes of their own.
    Killing ``rp`` with SIGKILL while sends wait on it lets them complete for the others within
    about a second; killing ``n2`` drops its subtree; restarting it at the same address brings
    its receiver back by itself, and deliveries resume."""
    procs: list[subprocess.Popen[str]] = []
    async with AsyncExitStack() as stack:
        stack.callback(lambda: [_kill(p) for p in procs])
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        root = RelayNode("n0", config=CONFIG)
        await tg.start(root.serve)
        addresses = {}
        for name in ("n1", "n2"):
            proc, addresses[name] = await _spawn("node", "--name", name, "--parent", root.address)
            procs.append(proc)
        rp, _ = await _spawn("receiver", "--name", "rp", "--node", addresses["n1"], "--delay", "2")
        procs.append(rp)
        owner = RelayTransport(root=root.address, config=CONFIG)
        ra = RelayTransport(node=addresses["n1"], config=CONFIG)
        rb = RelayTransport(node=addresses["n2"], config=CONFIG)
        for t in (owner, ra, rb):
            stack.push_async_callback(t.aclose)
        got: dict[str, list[PayloadKey]] = {"ra": [], "rb": []}

        async def take(name: str, t: RelayTransport) -> None:
            async for d in t.subscribe(name):
                got[name].append(d.key)
                await t.taken(name, d.key)

        tg.start_soon(take, "ra", ra)
        tg.start_soon(take, "rb", rb)
        await _wait(lambda: root.receivers() == {"ra", "rb", "rp"}, 10, "three receivers")

        done: list[PayloadKey] = []

        async def send(key: PayloadKey) -> None:
            await owner.send(key, bytes(1000))
            done.append(key)

        keys = [_key(1, "o0", pid) for pid in range(3)]
        for key in keys:
            tg.start_soon(send, key)
        await _wait(lambda: len(got["ra"]) == len(got["rb"]) == 3, 5, "ra and rb")
        await anyio.sleep(0.2)
        assert not done  # rp takes one payload every 2 s
        killed = time.monotonic()
        _kill(rp)
        await _wait(lambda: len(done) == 3, 5, "the sends after rp was killed")
        assert time.monotonic() - killed < 1.5
        assert root.receivers() == {"ra", "rb"}

        n2 = procs[1]
        _kill(n2)
        await _wait(lambda: root.receivers() == {"ra"}, 5, "n2's subtree dropped")
        with anyio.fail_after(5):
            await owner.send(_key(1, "o0", 3), b"while n2 is down")
        proc, address = await _spawn(
            "node", "--name", "n2", "--bind", addresses["n2"], "--parent", root.address
        )
        procs.append(proc)
        assert address == addresses["n2"]
        await _wait(lambda: root.receivers() == {"ra", "rb"}, 10, "rb re-subscribed")
        with anyio.fail_after(5):
            await owner.send(_key(1, "o0", 4), b"after the restart")
        assert got["rb"] == [*keys, _key(1, "o0", 4)]
        assert got["ra"] == [*keys, _key(1, "o0", 3), _key(1, "o0", 4)]
        stats = root.stats()
        assert stats.cross_bytes == stats.payload_bytes == 3 * 1000 + 16 + 17


# -- benchmark helper ---------------------------------------------------------------------------


async def test_relay_throughput_reports_positive_rates() -> None:
    result = await relay_throughput(count=8, size=256 << 10)
    assert result["raw_bytes_per_s"] > 0 and result["relay_bytes_per_s"] > 0
    assert result["relay_min_bytes_per_s"] <= result["relay_bytes_per_s"]
    assert result["ratio"] == pytest.approx(result["relay_bytes_per_s"] / result["raw_bytes_per_s"])
    assert result["hops"] == 5  # owner -> n0, n0 -> n1, n0 -> n2, n1 -> r0, n2 -> r1
    assert result["link_ratio"] == pytest.approx(5 * result["ratio"])


def test_tree_hops_count_the_links_each_payload_crosses() -> None:
    assert tree_hops(nodes=1, fanout=2, receivers=1) == 2  # owner -> root -> receiver
    assert tree_hops(nodes=3, fanout=2, receivers=1) == 3  # n1 only
    assert tree_hops(nodes=5, fanout=2, receivers=4) == 1 + 4 + 4  # every edge, 4 receivers
    assert tree_hops(nodes=4, fanout=1, receivers=1) == 3  # r0 on n1 below n0
    assert tree_hops(nodes=4, fanout=1, receivers=3) == 1 + 3 + 3  # a chain n0-n1-n2-n3


async def test_a_send_routed_to_a_receiver_that_just_died_completes() -> None:
    """A receiver dies (no goodbye) and a payload is routed to it before the pings notice:
    the failed hand-over must release the payload at once, not leave the owner's send
    waiting forever (a SIGKILLed relay node or receiver mid-refit)."""
    slow = RelayConfig(
        max_buffered=4, max_buffered_bytes=128 << 10, receiver_window=2,
        ping_interval_s=5.0, peer_timeout_s=30.0, max_payload_bytes=4 << 20,
    )  # fmt: skip
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        root = RelayNode("n0", config=slow)
        await tg.start(root.serve)
        owner = RelayTransport(root=root.address, config=slow)
        ra = RelayTransport(node=root.address, config=slow)
        rb = RelayTransport(node=root.address, config=slow)
        for t in (owner, ra):
            stack.push_async_callback(t.aclose)

        async def take(name: str, t: RelayTransport) -> None:
            async for d in t.subscribe(name):
                await t.taken(name, d.key)

        tg.start_soon(take, "ra", ra)
        tg.start_soon(take, "rb", rb)
        await _wait(lambda: root.receivers() == {"ra", "rb"}, 5, "both receivers")
        with anyio.fail_after(5):
            await owner.send(_key(1, "o0", 0), b"p")
        await rb.aclose()  # rb's process dies: its connection is gone, no unsubscribe
        await anyio.sleep(0.2)
        with anyio.fail_after(5):  # pings are 5 s apart: only the failed hand-over tells
            await owner.send(_key(1, "o0", 1), b"q")
        assert root.receivers() == {"ra"}


async def test_a_send_to_a_root_that_died_before_any_ping_fails_once_it_restarts() -> None:
    """A root grants a fresh owner's payload and dies before the owner's first keepalive; a
    new root comes up at the same address and answers pings.  The owner knew the old root's
    incarnation before its first request (the handshake), so the new one's ``PONG`` fails the
    send as retryable instead of leaving it waiting for an answer that died with the old root
    (a SIGKILLed root mid-refit stalled a whole fleet this way)."""
    slow = RelayConfig(
        max_buffered=4, max_buffered_bytes=128 << 10, receiver_window=2,
        ping_interval_s=0.5, peer_timeout_s=30.0, max_payload_bytes=4 << 20,
    )  # fmt: skip
    ctx = zmq.asyncio.Context()
    old = ctx.socket(zmq.ROUTER)
    port = old.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    owner = RelayTransport(root=address, config=slow)
    errors: list[TransportError] = []

    async def send() -> None:
        try:
            await owner.send(_key(1, "o0", 0), b"payload")
        except TransportError as exc:
            errors.append(exc)

    async def old_root() -> None:
        """Answer the handshake, grant the offer, take the data, then vanish."""
        while True:
            ident, header, *_ = await old.recv_multipart()
            frame = decode_header(header)
            if isinstance(frame, Ping):
                await old.send_multipart([ident, encode(Pong(nonce=12345))])
            elif isinstance(frame, Offer):
                await old.send_multipart([ident, encode(Grant(seq=frame.seq))])
            elif isinstance(frame, Data):
                return

    try:
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(5):
                tg.start_soon(send)
                await old_root()
            old.close(linger=0)
            await _start_when_bindable(tg, lambda: RelayNode("n0", bind=address, config=slow))
            with anyio.fail_after(10):  # a couple of ping intervals, not the peer timeout
                while not errors:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        assert [(e.check, e.retryable) for e in errors] == [("root-restarted", True)]
    finally:
        await owner.aclose()
        old.close(linger=0)
        ctx.term()
