"""The control channel against peers that lie: with the fleet's keys only keyring members
connect, a connection speaks only for the name its key belongs to, a name's calls reach only
its own key, supervisor-only replies are refused from the network, and one flooding peer
cannot crowd the others out.  Each attacker is a raw pyzmq socket on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest
import zmq
import zmq.asyncio
from test_control_zmq import CONFIG, _collect, _inbox, _status

from dcr.adapters.control.zmq import ZmqControl
from dcr.adapters.control.zmq.link import Hello
from dcr.adapters.security import COORDINATOR, Identity, KeyDir, Security, check_bind
from dcr.errors import ConfigError
from dcr.protocol import messages as msg
from dcr.testing.conformance import until

pytestmark = pytest.mark.anyio



@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    await until(predicate, timeout_s, what, poll_s=0.005)


def _keys(tmp_path: Path, *names: str) -> KeyDir:
    return KeyDir.init(
        tmp_path / "keys", [COORDINATOR, *(Identity("receiver", n) for n in names)]
    )


class _Raw:
    """An attacker's DEALER: optionally a CURVE client with some key pair."""

    def __init__(self, address: str, *, pair: tuple[bytes, bytes] | None = None,
                 server: bytes | None = None, routing_id: bytes | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if pair is not None:
            assert server is not None
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, pair[0])
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, pair[1])
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        self.sock.connect(address)

    async def send(
        self, control: ZmqControl, message: object, sender: str, wait_s: float = 10.0
    ) -> bool:
        """Queue ``message``; False when it could not be queued within ``wait_s``.  Once the
        coordinator refused its handshake a DEALER has no pipe until it reconnects, so a send
        may wait forever."""
        with anyio.move_on_after(wait_s):
            await self.sock.send(control.codec.encode(message, epoch=1, sender=sender))
            return True
        return False

    async def got_anything(self, wait_s: float) -> bool:
        with anyio.move_on_after(wait_s):
            await self.sock.recv_multipart()
            return True
        return False

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def test_keys_admit_only_keyring_members(tmp_path: Path) -> None:
    """A peer without a key, with a key of another fleet, or with a revoked key never gets a
    call through, and nothing but the coordinator's ZAP denials changes."""
    keys = KeyDir.init(
        tmp_path / "keys", [COORDINATOR, Identity("receiver", "rx-good"),
                            Identity("receiver", "rx-revoked")]
    )
    other = KeyDir.init(tmp_path / "other", [COORDINATOR, Identity("receiver", "rx-other")])
    revoked_pair = keys.pair(Identity("receiver", "rx-revoked"))
    hub = ZmqControl(config=CONFIG, security=Security(keys))
    good = None
    raws: list[_Raw] = []
    try:
        coordinator = await hub.coordinator()
        good = ZmqControl(address=coordinator.address, config=CONFIG, security=Security(keys))
        link = await good.endpoint("rx-good")
        server = keys.keyring().public(COORDINATOR)
        keys.revoke(Identity("receiver", "rx-revoked"))  # the coordinator is running
        raws = [
            _Raw(coordinator.address, routing_id=b"rx-plain"),
            _Raw(coordinator.address, pair=other.pair(Identity("receiver", "rx-other")),
                 server=server),
            _Raw(coordinator.address, pair=revoked_pair, server=server),
        ]
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            inbox = _inbox(tg, link)
            await link.set_status(_status("rx-good"))
            for raw, name in zip(raws, ("rx-plain", "rx-other", "rx-revoked"), strict=True):
                # refused peers: a message may never leave their socket
                await raw.send(hub, Hello(status=_status(name)), name, wait_s=1.0)
                await raw.send(hub, msg.GateClosed(attempt=1, receiver=name), name, wait_s=1.0)
            await coordinator.call("rx-good", msg.StartStreaming(attempt=1), epoch=1)
            await _until(lambda: len(inbox.got) == 1, 10, "the keyed endpoint's call")
            await _until(lambda: hub.auth["denied"] >= 2, 10, "the foreign keys refused")
            for raw in raws:
                assert not await raw.got_anything(0.3)
            assert replies == [_status("rx-good")]
            assert list(coordinator.endpoints()) == ["rx-good"]
            assert coordinator.drops == {}
            tg.cancel_scope.cancel()
    finally:
        for raw in raws:
            raw.close()
        if good is not None:
            await good.aclose()
        await hub.aclose()


async def test_a_key_speaks_only_for_its_own_name(tmp_path: Path) -> None:
    """mallory (a keyring member) sends ``Acked(receiver="r0")`` of epoch 999999, under its
    own name and under r0's; sets routing id ``r0`` to take r0's calls; reports ``Retired``;
    claims the owner role.  Every frame is dropped and counted; r0 gets its calls."""
    keys = _keys(tmp_path, "r0", "mallory")
    hub = ZmqControl(config=CONFIG, security=Security(keys))
    r0 = None
    raw = None
    try:
        coordinator = await hub.coordinator()
        r0 = ZmqControl(address=coordinator.address, config=CONFIG, security=Security(keys))
        link = await r0.endpoint("r0")
        raw = _Raw(coordinator.address, pair=keys.pair(Identity("receiver", "mallory")),
                   server=keys.keyring().public(COORDINATOR), routing_id=b"r0")
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            inbox = _inbox(tg, link)
            await link.set_status(_status("r0"))
            await _until(lambda: "r0" in coordinator.endpoints(), 10, "r0 to connect")
            forged = msg.Acked(attempt=5, receiver="r0", applied=(), post_apply_checked=True)
            await raw.send(hub, Hello(status=None), "mallory")  # mallory is connected
            await raw.send(hub, forged, "mallory")
            await raw.send(hub, forged, "r0")
            await raw.send(hub, Hello(status=_status("r0")), "r0")
            await raw.send(hub, Hello(status=_status("r0")), "mallory")
            await raw.send(hub, msg.Retired(attempt=5, endpoint="r0"), "mallory")
            await raw.send(hub, msg.Retired(attempt=5, endpoint="mallory"), "mallory")
            await raw.send(hub, dataclasses.replace(_status("mallory"), role="owner"), "mallory")
            sync = msg.GateClosed(attempt=5, receiver="mallory")
            await raw.send(hub, sync, "mallory")
            await _until(lambda: sync in replies, 10, "mallory's own honest reply")
            assert replies == [_status("r0"), sync]
            assert coordinator.drops == {
                "impersonation": 3, "sender": 2, "supervisor-only": 2,
            }
            await coordinator.call("r0", msg.Cleanup(attempt=5), epoch=1)
            await _until(lambda: len(inbox.got) == 1, 10, "r0's call")
            got = await raw.got_anything(0.3)  # pings for mallory may come; never r0's call
            while got:
                got = await raw.got_anything(0.3)
            assert inbox.got == [msg.Cleanup(attempt=5)]
            tg.cancel_scope.cancel()
    finally:
        if raw is not None:
            raw.close()
        if r0 is not None:
            await r0.aclose()
        await hub.aclose()


async def test_supervisor_only_and_forged_names_are_refused_without_keys() -> None:
    """On a loopback fleet (no keys) a connection still speaks only for its routing id's
    name, and ``Retired`` is refused from the network."""
    hub = ZmqControl(config=CONFIG)
    raw = None
    try:
        coordinator = await hub.coordinator()
        raw = _Raw(coordinator.address, routing_id=b"mallory")
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            forged = msg.Acked(attempt=5, receiver="r0", applied=(), post_apply_checked=True)
            await raw.send(hub, forged, "mallory")
            await raw.send(hub, msg.Retired(attempt=5, endpoint="mallory"), "mallory")
            sync = msg.GateClosed(attempt=5, receiver="mallory")
            await raw.send(hub, sync, "mallory")
            await _until(lambda: sync in replies, 10, "the honest reply")
            assert replies == [sync]
            assert coordinator.drops == {"impersonation": 1, "supervisor-only": 1}
            tg.cancel_scope.cancel()
    finally:
        if raw is not None:
            raw.close()
        await hub.aclose()


async def test_a_flooding_peer_cannot_crowd_out_the_others() -> None:
    """A peer that sends far more replies than the coordinator reads fills only its own share
    of the reply queue; another endpoint's reply still gets in."""
    config = dataclasses.replace(CONFIG, replies_buffer=64, replies_per_endpoint=8)
    hub = ZmqControl(config=config)
    raw = None
    try:
        coordinator = await hub.coordinator()
        raw = _Raw(coordinator.address, routing_id=b"flood")
        honest = _Raw(coordinator.address, routing_id=b"r0")
        for attempt in range(200):
            await raw.send(hub, msg.GateClosed(attempt=attempt, receiver="flood"), "flood")
        await _until(lambda: coordinator.drops["peer-overflow"] >= 200 - 8, 10, "the flood")
        await honest.send(hub, msg.GateClosed(attempt=1, receiver="r0"), "r0")
        replies: list[msg.Reply] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, coordinator, replies)
            await _until(lambda: len(replies) == 9, 10, "the queued replies")
            tg.cancel_scope.cancel()
        assert msg.GateClosed(attempt=1, receiver="r0") in replies
        assert coordinator.drops == {"peer-overflow": 192}
        honest.close()
    finally:
        if raw is not None:
            raw.close()
        await hub.aclose()


async def test_binding_off_this_host_needs_keys_or_an_explicit_insecure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator refuses to listen off this host without keys, before it binds (the
    address is a documentation one: nothing is ever bound off loopback here); with keys the
    same address passes the check silently, with ``insecure`` it passes with a warning."""
    off_host = "tcp://192.0.2.1:0"
    control = ZmqControl(config=dataclasses.replace(CONFIG, bind=off_host))
    try:
        with pytest.raises(ConfigError, match="insecure = true"):
            await control.coordinator()
        assert control.auth == {}
    finally:
        await control.aclose()
    for security in (Security(insecure=True), Security(_keys(tmp_path, "r0"))):
        with caplog.at_level(logging.WARNING):
            check_bind(off_host, security, "the control channel")
        insecure = [r for r in caplog.records if "INSECURE" in r.getMessage()]
        assert len(insecure) == (0 if security.keyed else 1)
        caplog.clear()
    with pytest.raises(ConfigError):
        check_bind(off_host, Security(), "the control channel")
    check_bind("tcp://127.0.0.1:0", Security(), "the control channel")  # loopback: always


async def test_an_endpoint_needs_its_key(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "r0")
    control = ZmqControl(address="tcp://127.0.0.1:1", config=CONFIG, security=Security(keys))
    try:
        with pytest.raises(ConfigError, match="receiver:r1"):
            await control.endpoint("r1")
    finally:
        await control.aclose()
