"""The relay tree against peers that lie or overreach: with the fleet's keys only keyring
members connect and a connection's role and name come from its key, never from its routing id;
every node holds each peer to bounds (the largest payload from the catalog and bucket size,
grants that time out, no queue for ungranted data, a bounded waiting queue per peer).  Each
attacker is a raw pyzmq DEALER on 127.0.0.1 against real relay nodes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.abc
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from dcr.adapters.security import COORDINATOR, Identity, KeyDir, Security
from dcr.adapters.transport.relay import (
    RelayConfig,
    RelayNode,
    RelayTransport,
    largest_payload,
    start_tree,
)
from dcr.adapters.transport.relay.frames import (
    Data,
    Frame,
    Grant,
    Offer,
    Payload,
    Ping,
    Pong,
    Query,
    Refused,
    Stop,
    Subscribe,
    decode_header,
    encode,
)
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.tensors.records import Encoding, Item, Span, TensorSpec
from dcr.wire.payload import PayloadHeader, encode_payload

pytestmark = pytest.mark.anyio

CONFIG = RelayConfig(
    max_buffered=4,
    max_buffered_bytes=128 << 10,
    receiver_window=2,
    ping_interval_s=0.1,
    peer_timeout_s=1.0,
    max_payload_bytes=4 << 20,
)
NODES = ("n0", "n1", "n2")
OWNER, MALLORY = Identity("owner", "o0"), Identity("owner", "mallory")
R0, R1 = Identity("receiver", "r0"), Identity("receiver", "r1")
RX_MALLORY = Identity("receiver", "mallory")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _key(attempt: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=attempt, owner=owner, payload_id=pid)


def _keys(tmp_path: Path) -> KeyDir:
    identities = [Identity("relay", n) for n in NODES]
    identities += [OWNER, MALLORY, R0, R1, RX_MALLORY, COORDINATOR]
    return KeyDir.init(tmp_path / "keys", identities)


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await anyio.sleep(0.02)


@asynccontextmanager
async def _tree(
    keys: KeyDir | None, config: RelayConfig = CONFIG, names: Sequence[str] = NODES
) -> AsyncIterator[dict[str, RelayNode]]:
    """A balanced tree (fan-out 2) of real relay nodes on 127.0.0.1, keyed with ``keys``."""
    async with anyio.create_task_group() as tg:
        security = Security(keys) if keys is not None else None
        yield await start_tree(tg, list(names), config=config, security=security)
        tg.cancel_scope.cancel()


class _Raw:
    """An attacker's DEALER: optionally a CURVE client with some key pair; it collects the
    frames it receives."""

    def __init__(
        self,
        address: str,
        *,
        pair: tuple[bytes, bytes] | None = None,
        server: bytes | None = None,
        routing_id: bytes | None = None,
    ) -> None:
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
        self.got: list[Frame] = []

    async def send(self, frame: Frame, *body: bytes, wait_s: float = 10.0) -> bool:
        """Queue ``frame``; False when it could not be queued within ``wait_s``.  Once a node
        refused its handshake a DEALER has no pipe until it reconnects, so a send may wait
        forever."""
        with anyio.move_on_after(wait_s):
            await self.sock.send_multipart([encode(frame), *body])
            return True
        return False

    async def collect(self, wait_s: float) -> list[Frame]:
        """Frames received within ``wait_s`` (added to :attr:`got`)."""
        with anyio.move_on_after(wait_s):
            while True:
                parts = await self.sock.recv_multipart()
                self.got.append(decode_header(parts[0]))
        return self.got

    async def expect(self, n: int, timeout_s: float = 10.0) -> list[Frame]:
        """Read until :attr:`got` holds ``n`` frames (bounded)."""
        with anyio.fail_after(timeout_s):
            while len(self.got) < n:
                parts = await self.sock.recv_multipart()
                self.got.append(decode_header(parts[0]))
        return self.got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _raw(node: RelayNode, keys: KeyDir, who: Identity, **kwargs: bytes) -> _Raw:
    """A raw CURVE DEALER of ``who``'s key pair to ``node``."""
    server = keys.keyring().public(Identity("relay", node.name))
    return _Raw(node.address, pair=keys.pair(who), server=server, **kwargs)


def _owner(node: RelayNode, keys: KeyDir, config: RelayConfig = CONFIG) -> RelayTransport:
    return RelayTransport(
        root=node.address, root_name=node.name, config=config, security=Security(keys),
        identity=OWNER,
    )  # fmt: skip


async def _subscribed(
    tg: anyio.abc.TaskGroup, node: RelayNode, keys: KeyDir, name: str, got: list[bytes]
) -> RelayTransport:
    t = RelayTransport(
        node=node.address, node_name=node.name, config=CONFIG, security=Security(keys)
    )

    async def take() -> None:
        async for d in t.subscribe(name):
            got.append(d.data)
            await t.taken(name, d.key)

    tg.start_soon(take)
    await _until(lambda: name in node.receivers(), 10, f"{name} subscribed")
    return t


# -- who may connect, and as what -------------------------------------------------------------


async def test_keys_admit_only_keyring_members(tmp_path: Path) -> None:
    """``c:evil`` without a key, with a key of another fleet, or with a revoked key gets
    nothing through: no answer, no state at the node, nothing but counted ZAP denials."""
    keys = _keys(tmp_path)
    other = KeyDir.init(tmp_path / "other", [Identity("owner", "evil")])
    revoked_pair = keys.pair(MALLORY)
    raws: list[_Raw] = []
    async with _tree(keys, names=["n0"]) as nodes:
        root = nodes["n0"]
        server = keys.keyring().public(Identity("relay", "n0"))
        keys.revoke(MALLORY)  # the node is running: it re-reads the keyring
        raws = [
            _Raw(root.address, routing_id=b"c:evil"),
            _Raw(
                root.address,
                pair=other.pair(Identity("owner", "evil")),
                server=server,
                routing_id=b"c:evil",
            ),
            _Raw(root.address, pair=revoked_pair, server=server, routing_id=b"c:evil"),
        ]
        try:
            for raw in raws:  # refused peers: a frame may never leave their socket
                await raw.send(Query(seq=1), wait_s=1.0)
                await raw.send(Offer(seq=2, key=_key(5, "o0", 0), size=10, to=None), wait_s=1.0)
                await raw.send(Stop(origin=0, seq=3, attempt=5, cleanup=False), wait_s=1.0)
            await _until(lambda: root.auth()["denied"] >= 2, 10, "the foreign keys refused")
            for raw in raws:
                assert await raw.collect(0.5) == []
            assert root.peers() == {} and root.drops == {} and root.waiting_offers() == {}
            assert root.held().peak_count == 0 and 5 not in root._stopped
            owner = _owner(root, keys)
            try:
                with anyio.fail_after(10):
                    await owner.send(_key(5, "o0", 0), b"the real owner")
                assert root.peers() == {"owner:o0": "client"}
            finally:
                await owner.aclose()
        finally:
            for raw in raws:
                raw.close()


async def test_a_receiver_key_is_no_client(tmp_path: Path) -> None:
    """A receiver's key, whatever routing id it sets, cannot query the tree, offer a payload
    or stop an attempt: each frame is a counted ``role`` drop and nothing answers."""
    keys = _keys(tmp_path)
    async with _tree(keys, names=["n0"]) as nodes:
        root = nodes["n0"]
        raw = _raw(root, keys, R0, routing_id=b"c:evil")
        try:
            await raw.send(Query(seq=1))
            await raw.send(Offer(seq=2, key=_key(5, "o0", 0), size=10, to=None))
            await raw.send(Stop(origin=0, seq=3, attempt=5, cleanup=False))
            await raw.send(Ping(nonce=0))
            await _until(lambda: root.drops["role"] == 4, 10, "four role drops")
            assert await raw.collect(0.3) == []
            assert dict(root.drops) == {"role": 4}
            assert root.peers() == {} and root.waiting_offers() == {}
            assert 5 not in root._stopped and root.held().peak_count == 0
        finally:
            raw.close()


async def test_a_stop_from_a_receiver_is_refused(tmp_path: Path) -> None:
    """A receiver's key sends the root a STOP (with cleanup) of the attempt in progress: the
    root drops it (``role``), and the attempt's payloads keep flowing to the receivers."""
    keys = _keys(tmp_path)
    async with _tree(keys) as nodes, anyio.create_task_group() as tg:
        root = nodes["n0"]
        got: list[bytes] = []
        rx = await _subscribed(tg, nodes["n1"], keys, "r0", got)
        raw = _raw(root, keys, R1)
        owner = _owner(root, keys)
        try:
            await raw.send(Stop(origin=0, seq=1, attempt=1, cleanup=True))
            await _until(lambda: root.drops["role"] == 1, 10, "the stop dropped")
            with anyio.fail_after(10):
                await owner.send(_key(1, "o0", 0), b"still attempt 1")
            await _until(lambda: got == [b"still attempt 1"], 10, "the delivery")
            assert 1 not in root._stopped and await raw.collect(0.2) == []
        finally:
            raw.close()
            await owner.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()


async def test_routing_id_r_r0_gets_nothing_of_r0(tmp_path: Path) -> None:
    """An owner key with routing id ``r:r0``, and another receiver's key subscribing under the
    name ``r0``, at r0's node: both are ``role`` drops, neither receives r0's payload; r0
    does.  (With keys ROUTER_HANDOVER is off: a second connection announcing the routing id
    ``r:r0`` would not even be admitted by ZeroMQ.)"""
    keys = _keys(tmp_path)
    async with _tree(keys) as nodes, anyio.create_task_group() as tg:
        leaf = nodes["n1"]
        got: list[bytes] = []
        rx = await _subscribed(tg, leaf, keys, "r0", got)
        subscribe = Subscribe(nonce=7, window=8, window_bytes=1 << 20, receiver="r0")
        raws = [_raw(leaf, keys, MALLORY, routing_id=b"r:r0"), _raw(leaf, keys, RX_MALLORY)]
        owner = _owner(nodes["n0"], keys)
        try:
            for raw in raws:
                for _ in range(3):
                    await raw.send(subscribe)
            await _until(lambda: leaf.drops["role"] == 6, 10, "six role drops")
            assert leaf.receivers() == {"r0"}
            with anyio.fail_after(10):
                await owner.send(_key(1, "o0", 0), b"for r0 only", to=frozenset({"r0"}))
            await _until(lambda: got == [b"for r0 only"], 10, "r0's delivery")
            for raw in raws:
                assert not [f for f in await raw.collect(0.5) if isinstance(f, Payload)]
            assert leaf.peers() == {"receiver:r0": "receiver"}
        finally:
            for raw in raws:
                raw.close()
            await owner.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()


async def test_non_loopback_bind_needs_keys() -> None:
    """Without keys a node refuses to listen off this host (checked before it binds; the
    address is a documentation one, so nothing could be bound there anyway)."""
    node = RelayNode("n0", bind="tcp://192.0.2.1:0", config=CONFIG)
    with pytest.raises(ConfigError, match="insecure"), anyio.fail_after(10):
        await node.serve()


# -- bounds ------------------------------------------------------------------------------------

CATALOG = {
    "w": TensorSpec(name="w", shape=(256, 256), dtype=torch.bfloat16),
    "b": TensorSpec(name="b", shape=(256,), dtype=torch.float32),
    "m": TensorSpec(name="m", shape=(64, 64), dtype=torch.int8),
}


def test_largest_payload_bounds_what_an_owner_encodes() -> None:
    """Payloads of every element of the catalog, in each encoding and location form (random
    ULP deltas, XOR masks, overwrites; listed indices, runs), never exceed the bound for a
    bucket of that many input bytes, and the bound is far below 1 GiB."""
    rng = np.random.default_rng(0)
    total = sum(s.nbytes for s in CATALOG.values())
    bound = largest_payload(CATALOG, bucket_bytes=total, chunk_bytes=1, largest_shard_bytes=0,
                            fan=1)  # fmt: skip
    assert bound < total * 8 < 1 << 30
    words = {torch.bfloat16: np.uint16, torch.float32: np.uint32, torch.int8: np.uint8}

    def item(spec: TensorSpec, encoding: Encoding, idx: np.ndarray | Span, n: int) -> Item:
        values = rng.integers(0, np.iinfo(words[spec.dtype]).max, n, dtype=words[spec.dtype])
        where = {"span": idx} if isinstance(idx, Span) else {"indices": idx}
        return Item(name=spec.name, shape=spec.shape, dtype=spec.dtype, encoding=encoding,
                    values=values, **where)  # type: ignore[arg-type]  # fmt: skip

    w, b, m = CATALOG["w"], CATALOG["b"], CATALOG["m"]
    odd = np.arange(1, w.numel, 2, dtype=np.int64)
    cases = [
        [item(w, Encoding.ULP, odd, odd.size),
         item(w, Encoding.XOR, odd - 1, odd.size),
         item(b, Encoding.XOR, np.sort(rng.choice(b.numel, 100, replace=False)), 100),
         item(m, Encoding.OVERWRITE, Span(0), m.numel)],
        [item(w, Encoding.OVERWRITE, Span(0), w.numel),
         item(b, Encoding.ULP, np.arange(0, b.numel, 3, dtype=np.int64), (b.numel + 2) // 3),
         item(m, Encoding.XOR, np.arange(0, m.numel, 2, dtype=np.int64), m.numel // 2)],
    ]  # fmt: skip
    for items in cases:
        payload = encode_payload(PayloadHeader(attempt=1, owner=0, payload_id=0), items)
        assert len(payload) <= bound, (len(payload), bound)


async def test_an_oversized_offer_is_refused(tmp_path: Path) -> None:
    """The root's largest payload follows from the catalog and bucket size: a 1 GiB offer is
    refused as ``oversized`` (not retryable), one of the bound itself is granted, and a
    message above ZeroMQ's limit never reaches the node."""
    keys = _keys(tmp_path)
    bound = largest_payload(CATALOG, bucket_bytes=64 << 10, chunk_bytes=32 << 10)
    assert bound < 8 << 20
    config = replace(CONFIG, max_payload_bytes=bound, max_buffered_bytes=bound)
    async with _tree(keys, config, names=["n0"]) as nodes:
        root = nodes["n0"]
        raw = _raw(root, keys, MALLORY)
        try:
            await raw.send(Offer(seq=1, key=_key(1, "mallory", 0), size=1 << 30, to=None))
            await raw.send(Offer(seq=2, key=_key(1, "mallory", 1), size=bound, to=None))
            await raw.expect(2)
            refused, granted = raw.got[:2]
            assert isinstance(refused, Refused) and refused.seq == 1
            assert (refused.check, refused.retryable) == ("oversized", False)
            assert isinstance(granted, Grant) and granted.seq == 2
            assert root.held().bytes == bound and root.drops == {"oversized": 1}
            await raw.sock.send_multipart([encode(Data(seq=3, size=bound + (2 << 20))),
                                           bytes(bound + (2 << 20))])  # fmt: skip
            await anyio.sleep(0.5)
            assert root.drops == {"oversized": 1} and root.stats().cross_bytes == 0
        finally:
            raw.close()


async def test_a_grant_whose_data_never_comes_is_reclaimed(tmp_path: Path) -> None:
    """Mallory's offer takes the root's whole buffer and her connection only pings after
    the grant: after grant_timeout_s the room is reclaimed (counted), mallory is refused, and
    the real owner, who waited, gets its grant and delivers."""
    keys = _keys(tmp_path)
    config = replace(CONFIG, max_buffered_bytes=1 << 20, grant_timeout_s=1.0)
    async with _tree(keys, config, names=["n0", "n1"]) as nodes, anyio.create_task_group() as tg:
        root = nodes["n0"]
        got: list[bytes] = []
        rx = await _subscribed(tg, nodes["n1"], keys, "r0", got)
        raw = _raw(root, keys, MALLORY)
        owner = _owner(root, keys, config)
        stop_pinging = anyio.Event()

        async def ping() -> None:
            while not stop_pinging.is_set():
                await raw.send(Ping(nonce=0))
                await anyio.sleep(0.05)

        try:
            await raw.send(Offer(seq=1, key=_key(1, "mallory", 0), size=1 << 20, to=None))
            tg.start_soon(ping)
            await _until(lambda: root.held().bytes == 1 << 20, 10, "mallory's grant")
            with anyio.fail_after(30):
                await owner.send(_key(1, "o0", 0), b"x" * 1000)
            assert got == [b"x" * 1000]
            assert root.grants_expired == 1 and root.peers_refused == {"grant-timeout": 1}
            frames = [f for f in await raw.collect(0.2) if not isinstance(f, Pong)]
            assert isinstance(frames[0], Grant)
            assert any(isinstance(f, Refused) and f.check == "grant-timeout" for f in frames)
            assert "owner:mallory" not in root.peers() and root.drops["cooloff"] > 0
        finally:
            stop_pinging.set()
            raw.close()
            await owner.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()


async def test_ungranted_data_behind_a_link_is_refused_before_it_is_queued(
    tmp_path: Path,
) -> None:
    """With link_gbps set, data nobody granted is refused at once (``lost``), never queued
    for the root's link; more of it than the peer's ungranted bound refuses the peer."""
    keys = _keys(tmp_path)
    config = replace(CONFIG, link_gbps=0.008, max_peer_ungranted_bytes=1 << 20,
                     peer_timeout_s=30.0)  # 1 MB/s; one window for the whole test  # fmt: skip
    async with _tree(keys, config, names=["n0"]) as nodes:
        root = nodes["n0"]
        raw = _raw(root, keys, MALLORY)
        try:
            for seq in (1, 2):
                await raw.send(Data(seq=seq, size=512 << 10), bytes(512 << 10))
            await raw.expect(2)
            assert [(f.seq, f.check, f.retryable) for f in raw.got if isinstance(f, Refused)] \
                == [(1, "lost", True), (2, "lost", True)]  # fmt: skip
            assert not root._arrivals and root.held().peak_bytes == 0
            await anyio.sleep(1.0)  # a queued MiB would be passing the 1 MB/s link by now
            assert root.ingress.stats().bytes == 0 and root.stats().cross_bytes == 0
            assert root.peers_refused == {}
            await raw.send(Data(seq=3, size=512 << 10), bytes(512 << 10))
            await _until(lambda: root.peers_refused == {"ungranted": 1}, 10, "mallory refused")
            assert root.drops["unknown"] == 3 and not root._arrivals
        finally:
            raw.close()


async def test_waiting_offers_are_bounded(tmp_path: Path) -> None:
    """A peer's offers waiting or granted are bounded (one offer more refuses the peer and
    drops them all), and so are all waiting offers together (a further one is ``busy``)."""
    keys = _keys(tmp_path)
    config = replace(CONFIG, max_buffered=4, max_peer_offers=8, max_waiting_offers=6)
    async with _tree(keys, config, names=["n0"]) as nodes:
        root = nodes["n0"]
        raw = _raw(root, keys, MALLORY)
        other = _raw(root, keys, OWNER)
        try:
            for seq in range(1, 9):  # 4 granted (max_buffered), 4 waiting
                await raw.send(Offer(seq=seq, key=_key(1, "mallory", seq), size=10, to=None))
            await _until(lambda: root.waiting_offers() == {"owner:mallory": 8}, 10, "8 offers")
            for seq in range(1, 4):  # 2 more wait, then the waiting queue is full
                await other.send(Offer(seq=seq, key=_key(1, "o0", seq), size=10, to=None))
            await other.expect(1)
            await other.collect(0.2)
            assert [(f.seq, f.check, f.retryable) for f in other.got] == [(3, "busy", True)]
            assert root.waiting_offers() == {"owner:mallory": 8, "owner:o0": 2}
            await raw.send(Offer(seq=9, key=_key(1, "mallory", 9), size=10, to=None))
            await _until(lambda: root.peers_refused == {"offers": 1}, 10, "mallory refused")
            assert root.waiting_offers() == {"owner:o0": 2}
            await raw.send(Offer(seq=10, key=_key(1, "mallory", 10), size=10, to=None))
            await _until(lambda: root.drops["cooloff"] == 1, 10, "mallory ignored")
            assert root.waiting_offers() == {"owner:o0": 2}
        finally:
            raw.close()
            other.close()


async def test_a_flooding_peer_holds_at_most_its_room(tmp_path: Path) -> None:
    """A peer that offers as much as its bounds allow and sends no data holds at most
    ``peer_held_bytes`` of the root's buffer at peak (Held accounting); the others get room."""
    keys = _keys(tmp_path)
    config = replace(
        CONFIG, max_payload_bytes=1 << 20, max_buffered=64, max_buffered_bytes=64 << 20,
        max_peer_granted_bytes=4 << 20, max_peer_offers=16, grant_timeout_s=60.0,
    )  # fmt: skip
    async with _tree(keys, config, names=["n0", "n1"]) as nodes, anyio.create_task_group() as tg:
        root = nodes["n0"]
        got: list[bytes] = []
        rx = await _subscribed(tg, nodes["n1"], keys, "r0", got)
        raw = _raw(root, keys, MALLORY)
        owner = _owner(root, keys, config)
        try:
            for seq in range(1, 17):
                await raw.send(Offer(seq=seq, key=_key(1, "mallory", seq), size=1 << 20,
                                     to=None))  # fmt: skip
            await _until(lambda: root.waiting_offers() == {"owner:mallory": 16}, 10, "offers")
            assert [type(f) for f in await raw.collect(0.5)] == [Grant] * 4
            held = root.held()
            assert held.bytes == held.peak_bytes == config.peer_held_bytes == 4 << 20
            with anyio.fail_after(10):
                await owner.send(_key(1, "o0", 0), bytes(1 << 20))
            assert root.peers_refused == {} and got == [bytes(1 << 20)]
        finally:
            raw.close()
            await owner.aclose()
            await rx.aclose()
            tg.cancel_scope.cancel()


# -- a keyed tree end to end -------------------------------------------------------------------


async def test_keyed_tree_delivers_bit_exact(tmp_path: Path) -> None:
    """Through a keyed 3-node tree (CURVE on every socket), bf16 weights and random bytes
    reach receivers on both leaves bit for bit; every connection was admitted by its key."""
    keys = _keys(tmp_path)
    weights = torch.randn(64, 33, dtype=torch.float32).to(torch.bfloat16)
    rng = np.random.default_rng(1)
    payloads = [weights.view(torch.uint8).numpy().tobytes(), rng.bytes(300_000), b"", b"x"]
    async with _tree(keys) as nodes, anyio.create_task_group() as tg:
        got: dict[str, list[bytes]] = {"r0": [], "r1": []}
        rxs = [await _subscribed(tg, nodes["n1"], keys, "r0", got["r0"]),
               await _subscribed(tg, nodes["n2"], keys, "r1", got["r1"])]  # fmt: skip
        owner = _owner(nodes["n0"], keys)
        try:
            await _until(lambda: nodes["n0"].receivers() == {"r0", "r1"}, 10, "both receivers")
            with anyio.fail_after(20):
                for pid, data in enumerate(payloads):
                    await owner.send(_key(1, "o0", pid), data)
            await _until(lambda: all(len(v) == len(payloads) for v in got.values()), 10, "all")
            for received in got.values():
                assert received == payloads
                back = torch.frombuffer(bytearray(received[0]), dtype=torch.bfloat16)
                assert bool((back.view(torch.int16) == weights.view(-1).view(torch.int16)).all())
            for node in nodes.values():
                assert not node.drops and not node.peers_refused and not node.auth()["denied"]
            assert nodes["n0"].auth()["allowed"] >= 3  # two child nodes and the owner
            assert nodes["n0"].peers() == {"relay:n1": "node", "relay:n2": "node",
                                           "owner:o0": "client"}  # fmt: skip
        finally:
            await owner.aclose()
            for t in rxs:
                await t.aclose()
            tg.cancel_scope.cancel()


async def test_a_keyed_transport_needs_its_identity_and_the_node_names(tmp_path: Path) -> None:
    """With keys, a transport without an identity or the root's name cannot send: a clear
    ConfigError, before anything connects."""
    keys = _keys(tmp_path)
    async with _tree(keys, names=["n0"]) as nodes:
        t = RelayTransport(root=nodes["n0"].address, config=CONFIG, security=Security(keys))
        try:
            with pytest.raises(ConfigError, match="identity"):
                await t.send(_key(1, "o0", 0), b"x")
        finally:
            await t.aclose()
        wrong = RelayTransport(root=nodes["n0"].address, root_name="n1", config=CONFIG,
                               security=Security(keys), identity=OWNER)  # fmt: skip
        try:
            with pytest.raises(TransportError) as info:  # the root's key is not n1's
                await wrong.send(_key(1, "o0", 0), b"x")
            assert info.value.check == "peer-lost"
        finally:
            await wrong.aclose()


def test_a_fleet_derives_its_relay_bound_from_catalog_and_buckets(tmp_path: Path) -> None:
    """A fleet's relay nodes take at most the largest payload its owners can produce (its
    catalog, training plan and bucket size), far below the 1 GiB default; ``[transport]
    max_payload_bytes`` overrides it."""
    from dcr.demo import demo_fleet_file
    from dcr.fleet.config import load_fleet
    from dcr.fleet.relay import payload_bound, relay_config

    cfg = load_fleet(demo_fleet_file(tmp_path / "a", keys=False))
    bound = payload_bound(cfg)
    assert bound is not None and bound < RelayConfig().max_payload_bytes // 2
    assert relay_config(cfg).max_payload_bytes == bound
    bigger = load_fleet(demo_fleet_file(tmp_path / "b", keys=False, bucket_mb=64.0))
    assert payload_bound(bigger) > bound  # type: ignore[operator]
    path = demo_fleet_file(tmp_path / "c", keys=False)
    path.write_text(path.read_text().replace("fanout = 2", "fanout = 2\nmax_payload_bytes = 12345"))
    assert relay_config(load_fleet(path)).max_payload_bytes == 12345
