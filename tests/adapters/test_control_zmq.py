"""The ZeroMQ control channel: the conformance suite over real TCP on 127.0.0.1, coordinator
failover through a SQLite commit store, damaged frames, and an endpoint process
killed with SIGKILL and restarted."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.control.codec import FORMAT_VERSION, ControlCodec
from dcr.adapters.control.zmq import (
    COORDINATOR,
    LINK_MESSAGES,
    Bye,
    Hello,
    Ping,
    ZmqControl,
    ZmqControlConfig,
    ZmqCoordinatorLink,
    ZmqEndpointLink,
)
from dcr.adapters.registry import load
from dcr.errors import ConfigError
from dcr.protocol import messages as msg
from dcr.testing.control import EXAMPLES, ControlHarness, ControlTests, Inbox

pytestmark = pytest.mark.anyio

CONFIG = ZmqControlConfig(ping_s=0.1, peer_timeout_s=1.0, watch_s=0.05)
"""Fast heartbeats and store polling so that the tests see connections change quickly."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await anyio.sleep(0.005)


class ZmqHarness(ControlHarness):
    """A coordinator's :class:`ZmqControl` plus one :class:`ZmqControl` (own context, fixed
    coordinator address) per endpoint link, as separate processes would have."""

    def __init__(self) -> None:
        self.hub = ZmqControl(config=CONFIG)
        self.controls: list[ZmqControl] = []
        self._coordinator: ZmqCoordinatorLink | None = None

    async def coordinator(self) -> ZmqCoordinatorLink:
        if self._coordinator is None:
            self._coordinator = await self.hub.coordinator()
        return self._coordinator

    async def endpoint(self, name: str) -> ZmqEndpointLink:
        coordinator = await self.coordinator()
        control = ZmqControl(address=coordinator.address, config=CONFIG)
        self.controls.append(control)
        return await control.endpoint(name)

    def dropped_pending(self) -> int:
        return 0 if self._coordinator is None else self._coordinator.drops["pending-overflow"]

    async def settle(
        self, *, connected: Collection[str] = (), disconnected: Collection[str] = ()
    ) -> None:
        coordinator = await self.coordinator()

        def known() -> bool:
            seen = coordinator.endpoints()
            return all(n in seen for n in connected) and not any(n in seen for n in disconnected)

        await _until(known, 10, f"connected={list(connected)} disconnected={list(disconnected)}")

    async def aclose(self) -> None:
        for control in self.controls:
            await control.aclose()
        await self.hub.aclose()


class TestZmqControl(ControlTests):
    def make_harness(self) -> ControlHarness:
        return ZmqHarness()


def test_zmq_control_is_registered() -> None:
    assert load("control", "zmq") is ZmqControl


# -- helpers for the tests below ------------------------------------------------------------------


def _mark(attempt: int) -> msg.StartStreaming:
    return msg.StartStreaming(attempt=attempt)


def _attempts(calls: list[msg.Call]) -> list[int]:
    return [c.attempt for c in calls if isinstance(c, msg.StartStreaming)]


def _status(name: str, incarnation: str = "i1") -> msg.EndpointStatus:
    return msg.EndpointStatus(endpoint=name, role="receiver", incarnation=incarnation, record=None)


async def _collect(link: ZmqCoordinatorLink, into: list[msg.Reply]) -> None:
    async for reply in link.replies():
        into.append(reply)


def _inbox(tg: anyio.abc.TaskGroup, link: ZmqEndpointLink) -> Inbox:
    inbox = Inbox(link=link)
    tg.start_soon(inbox.run)
    return inbox


# -- failover -------------------------------------------------------------------------------------


async def test_endpoint_follows_the_store_to_a_standby_coordinator(tmp_path: Path) -> None:
    """The endpoint finds its coordinator in a SQLite commit store; when a standby claims a
    newer epoch at another address, the endpoint moves there, re-sends its status, and
    refuses calls of the old epoch."""
    store = SqliteCommitStore(tmp_path / "commit.db")
    first, second = ZmqControl(config=CONFIG), ZmqControl(config=CONFIG)
    worker = ZmqControl(store=store, config=CONFIG)
    status = _status("rx-0")
    try:
        old = await first.coordinator()
        link = await worker.endpoint("rx-0")
        await link.set_status(status)  # no coordinator claimed yet: nowhere to send it
        assert link.address == "" and link.drops["no-coordinator"] == 1
        old_epoch = await store.claim(address=old.address)
        old_replies: list[msg.Reply] = []
        new_replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, old, old_replies)
            inbox = _inbox(tg, link)
            await _until(lambda: status in old_replies, 5, "the status at the first coordinator")
            assert link.address == old.address and link.epoch == old_epoch
            await old.call("rx-0", _mark(1), epoch=old_epoch)
            await _until(lambda: len(inbox.got) == 1, 5, "a call of the first coordinator")

            new = await second.coordinator()
            tg.start_soon(_collect, new, new_replies)
            new_epoch = await store.claim(address=new.address)
            await _until(lambda: status in new_replies, 5, "the status at the new coordinator")
            assert link.address == new.address and link.epoch == new_epoch > old_epoch
            await _until(lambda: "rx-0" not in old.endpoints(), 5, "the goodbye to the old one")
            assert list(new.endpoints()) == ["rx-0"]

            await old.call("rx-0", _mark(2), epoch=old_epoch)  # waits at the replaced one
            await new.call("rx-0", _mark(3), epoch=old_epoch)  # a late call of the old epoch
            await new.call("rx-0", _mark(4), epoch=new_epoch)
            await _until(lambda: 4 in _attempts(inbox.got), 5, "a call of the new coordinator")
            assert _attempts(inbox.got) == [1, 4]
            assert link.drops["stale-epoch"] == 1
            assert old.pending("rx-0") == 1
            tg.cancel_scope.cancel()
    finally:
        await worker.aclose()
        await first.aclose()
        await second.aclose()
        await store.close()


# -- damaged frames -------------------------------------------------------------------------------


def _damaged(codec: ControlCodec, sender: str) -> list[tuple[list[bytes], str]]:
    """Frames that must be dropped, each with the drop counter it must raise."""
    call = codec.encode(_mark(1), epoch=1, sender=COORDINATOR)
    reply = codec.encode(msg.GateClosed(attempt=1, receiver=sender), epoch=1, sender=sender)
    body = {"attempt": 1, "receiver": sender}
    return [
        ([b"\xc1garbage"], "malformed"),
        ([b""], "truncated"),
        ([reply[:-2]], "truncated"),
        ([b"\x00" * (CONFIG.max_message_bytes + 1)], "oversized"),
        ([msgspec.msgpack.encode([FORMAT_VERSION + 1, "GateClosed", 1, sender, body])], "version"),
        ([msgspec.msgpack.encode([FORMAT_VERSION, "GateOpen", 1, sender, body])], "type"),
        (
            [msgspec.msgpack.encode([FORMAT_VERSION, "GateClosed", 1, sender, {**body, "x": 1}])],
            "schema",
        ),
        ([call, reply], "parts"),
    ]


async def test_damaged_frames_at_a_coordinator_are_dropped_and_counted() -> None:
    hub = ZmqControl(config=CONFIG)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    worker: ZmqControl | None = None
    try:
        coordinator = await hub.coordinator()
        worker = ZmqControl(address=coordinator.address, config=CONFIG)
        link = await worker.endpoint("rx-0")
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"rx-9")
        raw.connect(coordinator.address)
        codec = hub.codec
        cases = _damaged(codec, "rx-9")
        cases += [
            ([codec.encode(_mark(1), epoch=1, sender="rx-9")], "direction"),
            ([codec.encode(Ping(), epoch=1, sender="rx-9")], "direction"),
            ([codec.encode(Hello(status=None), epoch=1, sender="rx-0")], "sender"),
            ([codec.encode(msg.GateClosed(attempt=1, receiver="x"), epoch=1, sender="")], "sender"),
        ]
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            inbox = _inbox(tg, link)
            await _until(lambda: "rx-0" in coordinator.endpoints(), 5, "rx-0 to connect")
            before = (coordinator.endpoints(), dict(coordinator.drops))
            for parts, _ in cases:
                await raw.send_multipart(parts)
            sync = msg.GateClosed(attempt=2, receiver="rx-9")
            await raw.send(codec.encode(sync, epoch=1, sender="rx-9"))
            await _until(lambda: sync in replies, 5, "the frame after the damaged ones")
            assert replies == [sync]
            assert coordinator.endpoints() == before[0] and before[1] == {}
            assert coordinator.drops == Counter(check for _, check in cases)
            await coordinator.call("rx-0", _mark(5), epoch=1)
            await _until(lambda: _attempts(inbox.got) == [5], 5, "a call after the damage")
            tg.cancel_scope.cancel()
    finally:
        raw.close(linger=0)
        ctx.term()
        if worker is not None:
            await worker.aclose()
        await hub.aclose()


async def test_damaged_frames_at_an_endpoint_are_dropped_and_counted() -> None:
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.ROUTER)
    worker: ZmqControl | None = None
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = raw.bind_to_random_port("tcp://127.0.0.1")
        worker = ZmqControl(address=f"tcp://127.0.0.1:{port}", config=CONFIG)
        codec = worker.codec
        link = await worker.endpoint("rx-0")
        with anyio.fail_after(5):
            ident, hello = await raw.recv_multipart()
        assert ident == b"rx-0"
        envelope = codec.decode(hello)
        assert envelope.message == Hello(status=None) and envelope.sender == "rx-0"
        cases = _damaged(codec, COORDINATOR)
        cases += [
            ([codec.encode(_status("x"), epoch=1, sender=COORDINATOR)], "direction"),
            ([codec.encode(Hello(status=None), epoch=1, sender=COORDINATOR)], "direction"),
            ([codec.encode(Bye(), epoch=1, sender=COORDINATOR)], "direction"),
        ]
        async with anyio.create_task_group() as tg:
            inbox = _inbox(tg, link)
            for parts, _ in cases:
                await raw.send_multipart([b"rx-0", *parts])
            await raw.send_multipart([b"rx-0", codec.encode(Ping(), epoch=1, sender=COORDINATOR)])
            await raw.send_multipart([b"rx-0", codec.encode(_mark(7), epoch=1, sender="c")])
            await _until(lambda: len(inbox.got) >= 1, 5, "the call after the damaged frames")
            await anyio.sleep(0.1)
            assert _attempts(inbox.got) == [7] and link.epoch == 1
            assert link.drops == Counter(check for _, check in cases)
            tg.cancel_scope.cancel()
    finally:
        raw.close(linger=0)
        ctx.term()
        if worker is not None:
            await worker.aclose()


def test_link_messages_round_trip() -> None:
    codec = ZmqControl(config=CONFIG).codec
    assert set(LINK_MESSAGES) <= set(codec.types) and set(msg.MESSAGES) <= set(codec.types)
    for message in (Hello(status=None), Hello(status=_status("a")), Bye(), Ping(), *EXAMPLES):
        data = codec.encode(message, epoch=2, sender="a")
        assert codec.decode(data).message == message


# -- configuration errors -------------------------------------------------------------------------


async def test_bad_configuration_raises_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ZmqControlConfig(ping_s=0)
    with pytest.raises(ConfigError):
        ZmqControlConfig(ping_s=2.0, peer_timeout_s=1.0)
    cases = [
        (ZmqControl(config=CONFIG), "rx-0"),
        (ZmqControl(address="not an address", config=CONFIG), "rx-0"),
        (ZmqControl(address="tcp://127.0.0.1:1", config=CONFIG), ""),
        (ZmqControl(address="tcp://127.0.0.1:1", config=CONFIG), "\x00rx"),
        (ZmqControl(address="tcp://127.0.0.1:1", config=CONFIG), "x" * 256),
    ]
    for control, name in cases:
        try:
            with pytest.raises(ConfigError):
                await control.endpoint(name)
        finally:
            await control.aclose()
    for config in (
        dataclasses.replace(CONFIG, bind="tcp://256.1.1.1:0"),
        dataclasses.replace(CONFIG, bind="nonsense"),
        dataclasses.replace(CONFIG, bind="tcp://0.0.0.0:0"),  # off this host without keys
    ):
        control = ZmqControl(config=config)
        try:
            with pytest.raises(ConfigError):
                await control.coordinator()
        finally:
            await control.aclose()
    control = ZmqControl(config=CONFIG)
    try:
        coordinator = await control.coordinator()
        with pytest.raises(ConfigError):
            await coordinator.call("", _mark(1), epoch=1)
    finally:
        await control.aclose()


# -- a real endpoint process, killed and restarted ------------------------------------------------

ECHO = """
import os, sys
import anyio
from dcr.adapters.control.zmq import ZmqControl, ZmqControlConfig
from dcr.protocol import messages as msg

async def main(address: str, name: str) -> None:
    control = ZmqControl(address=address, config=ZmqControlConfig(ping_s=0.1, peer_timeout_s=1.0))
    me = str(os.getpid())
    try:
        link = await control.endpoint(name)
        await link.set_status(
            msg.EndpointStatus(endpoint=name, role="owner", incarnation=me, record=None)
        )
        with anyio.move_on_after(60):
            async for call in link.calls():
                attempt = getattr(call, "attempt", -1)
                await link.notify(
                    msg.AttemptFailed(attempt=attempt, endpoint=name, check="echo", message=me)
                )
    finally:
        await control.aclose()

anyio.run(main, sys.argv[1], sys.argv[2], backend="asyncio")
"""
"""An endpoint process that answers every call with an ``AttemptFailed`` naming its pid."""


def _echoes(replies: list[msg.Reply], pid: int) -> list[int]:
    return [
        r.attempt
        for r in replies
        if isinstance(r, msg.AttemptFailed) and r.check == "echo" and r.message == str(pid)
    ]


def _started(replies: list[msg.Reply], pid: int) -> bool:
    return any(isinstance(r, msg.EndpointStatus) and r.incarnation == str(pid) for r in replies)


async def test_endpoint_process_killed_and_restarted_gets_the_calls_made_meanwhile(
    tmp_path: Path,
) -> None:
    hub = ZmqControl(config=CONFIG)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def spawn(address: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"endpoint-{len(procs)}.log"
        logs.append(log)
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", ECHO, address, "owner-x"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=Path(__file__).resolve().parents[2],
            )
        procs.append(proc)
        return proc

    try:
        coordinator = await hub.coordinator()
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            first = spawn(coordinator.address)
            await _until(lambda: _started(replies, first.pid), 60, "the first process")
            await coordinator.call("owner-x", _mark(1), epoch=1)
            await _until(lambda: _echoes(replies, first.pid) == [1], 10, "the first echo")

            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
            await _until(lambda: "owner-x" not in coordinator.endpoints(), 5, "the kill noticed")
            for i in (2, 3, 4):
                await coordinator.call("owner-x", _mark(i), epoch=1)
            assert coordinator.pending("owner-x") == 3

            second = spawn(coordinator.address)
            await _until(lambda: len(_echoes(replies, second.pid)) >= 3, 60, "the queued calls")
            assert _echoes(replies, second.pid) == [2, 3, 4]
            assert coordinator.pending("owner-x") == 0
            tg.cancel_scope.cancel()
    except BaseException:
        for log in logs:
            print(log.read_text(errors="replace"))
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        await hub.aclose()


async def test_a_coordinator_that_did_not_run_does_not_count_that_time_as_silence() -> None:
    """A starved or paused coordinator process wakes to find its peers' heartbeats unread:
    its link does not forget them for the silence it did not listen to, and still forgets a
    peer that stays silent afterwards."""
    hub = ZmqControl(config=CONFIG)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        coordinator = await hub.coordinator()
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"rx-1")
        raw.connect(coordinator.address)
        await raw.send(hub.codec.encode(Hello(status=None), epoch=1, sender="rx-1"))
        await _until(lambda: "rx-1" in coordinator.endpoints(), 10, "rx-1 to say hello")
        time.sleep(CONFIG.peer_timeout_s * 1.6)  # the whole process stalls (no await)
        await anyio.sleep(CONFIG.ping_s * 3)
        assert "rx-1" in coordinator.endpoints()
        assert coordinator.stalled_s > CONFIG.peer_timeout_s
        await _until(lambda: "rx-1" not in coordinator.endpoints(), 10, "the silence noticed")
    finally:
        raw.close(linger=0)
        ctx.term()
        await hub.aclose()
