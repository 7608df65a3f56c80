"""The object-storage transport: the conformance suite on a directory, on moto's S3 and on a
real SeaweedFS, plus what the suite cannot check here (cleanup of stored objects, stops that
reach senders in other processes, multipart objects, tombstone expiry)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

import anyio
import pytest

from dcr.adapters.registry import load
from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.adapters.transport.directory import DirectoryBackend, DirectoryTransport
from dcr.adapters.transport.objstore import (
    ObjectStoreConfig,
    ObjectStoreTransport,
    decode_segment,
    encode_segment,
    tombstone_key,
)
from dcr.adapters.transport.s3 import S3Transport
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.testing.s3servers import S3Endpoint
from dcr.testing.transport import TransportHarness, TransportTests

pytestmark = pytest.mark.anyio

FAST = dict(poll_s=0.02, arrival_grace_s=10.0, backoff_s=0.01, backoff_max_s=0.1)
"""Quick polling, and an arrival promise the suite checks the transport keeps (10 s: on a loaded
2-core machine a receiver's listing loop has been starved for 3 s)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Make = Callable[[], ObjectStoreTransport]


class ObjectStoreHarness(TransportHarness):
    """Every owner and the coordinator get a transport object of their own (as separate
    processes would); all receivers subscribe on one more: one rollout node, whose fetches
    they share, so what it fetched is what crossed into the rollout side."""

    def __init__(self, make: Make) -> None:
        self.make = make
        self.node: ObjectStoreTransport | None = None
        self.opened: list[ObjectStoreTransport] = []

    def _new(self) -> ObjectStoreTransport:
        t = self.make()
        self.opened.append(t)
        return t

    async def sender(self, owner: str) -> Transport:
        return self._new()

    async def receiver(self, name: str) -> Transport:
        if self.node is None:
            self.node = self._new()
        return self.node

    async def controller(self) -> Transport:
        return self._new()

    async def vanish(self, name: str) -> None:
        assert self.node is not None
        self.node.unsubscribe(name)

    async def settle(self, receivers: Collection[str]) -> None:
        return None

    def boundary_stats(self) -> TransportStats:
        assert self.node is not None
        return self.node.fetch_stats().traffic

    async def aclose(self) -> None:
        for t in self.opened:
            await t.aclose()


def directory_maker(root: Path, **settings: object) -> Make:
    return lambda: DirectoryTransport(root, fsync=False, **{**FAST, **settings})  # type: ignore[arg-type]


def s3_maker(endpoint: S3Endpoint, bucket: str, **settings: object) -> Make:
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    return lambda: S3Transport(  # type: ignore[arg-type]
        bucket=bucket, prefix=prefix, endpoint_url=endpoint.url, addressing_style="path",
        **{**FAST, **settings},
    )  # fmt: skip


@pytest.fixture(scope="module")
def moto_bucket(moto_s3: S3Endpoint) -> str:
    return moto_s3.create_bucket()


@pytest.fixture(scope="module")
def seaweed_bucket(seaweed_s3: S3Endpoint) -> str:
    return seaweed_s3.create_bucket()


@pytest.fixture(params=["directory", "moto", "seaweedfs"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    if request.param == "directory":
        return directory_maker(tmp_path / "objects")
    if request.param == "moto":
        return s3_maker(request.getfixturevalue("moto_s3"), request.getfixturevalue("moto_bucket"))
    return s3_maker(
        request.getfixturevalue("seaweed_s3"), request.getfixturevalue("seaweed_bucket")
    )


class TestObjectStoreTransport(TransportTests):
    """The suite on a directory, on moto's S3 and on SeaweedFS (the ``make`` fixture)."""

    # Object storage decouples the sides: a send returns once the payload and its manifest
    # entry are stored, whatever receivers do; a receiver that stops taking stops its node's
    # fetches for it at its window (test_window_bounds_fetches).
    credit = False
    # Cleanup deletes the attempt's objects at once, so payloads a node has not fetched by
    # then are gone (the protocol cleans up only after commit or a completed stop, when
    # receivers need nothing more of the attempt); the rest of the check runs in
    # test_cleanup_deletes_the_attempt.
    keeps_sent_at_cleanup = False
    timeout_s = 30.0

    @pytest.fixture(autouse=True)
    def _make(self, make: Make) -> None:
        self.make = make

    def make_harness(self) -> TransportHarness:
        return ObjectStoreHarness(self.make)

    def check_world(self, harness: TransportHarness) -> None:
        assert isinstance(harness, ObjectStoreHarness)
        if harness.node is not None:
            stats = harness.node.fetch_stats()
            assert (stats.damaged, stats.missing, stats.bad_entries) == (0, 0, 0), stats


# -- what the suite leaves to this module --------------------------------------------------------


def _key(attempt: int, owner: str, pid: int) -> PayloadKey:
    return PayloadKey(attempt=attempt, owner=owner, payload_id=pid)


async def _collect(transport: Transport, name: str, got: list[Delivery], take: bool = True) -> None:
    async for d in transport.subscribe(name):
        got.append(d)
        if take:
            await transport.taken(name, d.key)


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(0.01)


async def test_cleanup_deletes_the_attempt(make: Make) -> None:
    """Once every payload was fetched, cleanup leaves nothing of the attempt but its
    tombstone, is idempotent, accepts unknown attempts, refuses later sends of the attempt
    (also from a process that did not clean up) and leaves other attempts alone."""
    owner, node, control = make(), make(), make()
    try:
        got: list[Delivery] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, node, "r0", got)
            keys = [_key(3, "o0", pid) for pid in range(3)]
            for k in keys:
                await owner.send(k, b"x" * (100 + k.payload_id))
            await _until(lambda: len(got) == 3, "the attempt's payloads")
            await control.cleanup(3)
            await control.cleanup(3)
            await control.cleanup(99)
            left = {o.key for o in await control.backend.list("")}
            assert left == {tombstone_key(3), tombstone_key(99)}, left
            with pytest.raises(TransportError) as refused:
                await owner.send(_key(3, "o0", 5), b"late")
            assert (refused.value.retryable, refused.value.check) == (False, "stopped")
            await owner.send(_key(4, "o0", 0), b"next")
            await _until(lambda: len(got) == 4, "the next attempt")
            assert [d.key for d in got] == [*keys, _key(4, "o0", 0)]
            assert [d.data for d in got][-1] == b"next"
            tg.cancel_scope.cancel()
    finally:
        for t in (owner, node, control):
            await t.aclose()


async def test_a_late_upload_of_a_stopped_attempt_deletes_itself(make: Make) -> None:
    """A send whose upload was under way when another process stopped the attempt finds
    the tombstone after its upload, deletes its object and is refused; nodes fetch nothing
    of a stopped attempt, even objects a writer that skipped every check left behind."""
    owner, node, control = make(), make(), make()
    try:
        gate = anyio.Event()
        put = owner.backend.put

        async def slow_put(key: str, data: bytes, **kw: object) -> None:
            if key.startswith("payload/"):
                await gate.wait()  # the upload lands only after stop_and_wait returned
            await put(key, data, **kw)  # type: ignore[arg-type]

        owner.backend.put = slow_put  # type: ignore[method-assign]
        got: list[Delivery] = []
        outcome: list[BaseException | None] = []

        async def send() -> None:
            try:
                await owner.send(_key(5, "o0", 0), b"payload")
                outcome.append(None)
            except TransportError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, node, "r0", got)
            tg.start_soon(send)
            await anyio.sleep(0.2)
            with anyio.fail_after(10):
                await control.stop_and_wait(5)
            gate.set()
            await _until(lambda: bool(outcome), "the late send")
            exc = outcome[0]
            assert isinstance(exc, TransportError) and exc.check == "stopped", exc
            assert {o.key for o in await control.backend.list("")} == {tombstone_key(5)}
            # A writer that ignores the rules stores a payload and entry for the attempt.
            rogue = make()
            rogue._sender._guard = lambda attempt: anyio.sleep(0)  # type: ignore[method-assign]
            await rogue.send(_key(5, "o9", 0), b"rogue")
            await owner.send(_key(6, "o0", 0), b"fresh")
            await _until(lambda: len(got) == 1, "the next attempt")
            await anyio.sleep(0.2)
            assert [d.key for d in got] == [_key(6, "o0", 0)]
            await control.cleanup(5)
            assert await control.backend.list("payload/00000000000000000005/") == []
            await rogue.aclose()
            tg.cancel_scope.cancel()
    finally:
        for t in (owner, node, control):
            await t.aclose()


async def test_window_bounds_fetches(make: Make) -> None:
    """A receiver that takes nothing holds at most its window of deliveries; its node
    fetches nothing more for it until it takes again, and another receiver of the node is
    held back only for payloads addressed to both."""
    owner, node = make(), make()
    window = node.receiver_window
    try:
        slow: list[Delivery] = []
        fast: list[Delivery] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, node, "slow", slow, False)
            tg.start_soon(_collect, node, "fast", fast)
            n = window + 4
            for pid in range(n):
                await owner.send(_key(1, "o0", pid), bytes([pid]) * 64)
            only_fast = _key(1, "o1", 0)
            await owner.send(only_fast, b"f", to=frozenset({"fast"}))
            await _until(lambda: only_fast in [d.key for d in fast], "the payload for fast")
            await _until(lambda: len(slow) >= window, "a full window for slow")
            await anyio.sleep(0.3)
            assert len(slow) == window
            assert node.fetch_stats().traffic.payloads <= window + node.config.fetch_concurrency + 1
            for d in list(slow):
                await node.taken("slow", d.key)
            await _until(lambda: len(slow) == n, "the rest for slow")
            assert [d.key.payload_id for d in slow] == list(range(n))
            tg.cancel_scope.cancel()
    finally:
        await owner.aclose()
        await node.aclose()


async def test_expired_tombstones_are_swept(tmp_path: Path) -> None:
    """A later cleanup removes what a dead writer left of a stopped attempt, and the
    tombstone, once the tombstone is older than tombstone_ttl_s."""
    make = directory_maker(tmp_path, tombstone_ttl_s=0.0)
    a, b = make(), make()
    try:
        await a.stop_and_wait(7)
        leftover = "payload/00000000000000000007/o0/0123456789abcdef.0000000000"
        await a.backend.put(leftover, b"left behind")
        await anyio.sleep(0.05)
        await b.cleanup(8)
        assert await a.backend.list("") == []
    finally:
        await a.aclose()
        await b.aclose()


async def test_multipart_upload_round_trip(moto_s3: S3Endpoint, moto_bucket: str) -> None:
    """A payload above the multipart threshold is uploaded in parts and fetched whole."""
    make = s3_maker(moto_s3, moto_bucket, multipart_threshold_mb=5, part_mb=5)
    owner, node = make(), make()
    try:
        data = bytes(range(256)) * ((11 << 20) // 256)
        got: list[Delivery] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, node, "r0", got)
            await owner.send(_key(1, "o0", 0), data)
            await _until(lambda: bool(got), "the multipart payload")
            assert got[0].data == data
            tg.cancel_scope.cancel()
        uploads = await owner.backend.client()
        listed = await uploads.list_multipart_uploads(Bucket=moto_bucket)
        assert not listed.get("Uploads")
    finally:
        await owner.aclose()
        await node.aclose()


def test_key_segments_round_trip() -> None:
    for name in ("o0", "a.b", "..", "x/y", "ü", "%41"):
        seg = encode_segment(name)
        assert "/" not in seg and "." not in seg and decode_segment(seg) == name
    with pytest.raises(ConfigError):
        encode_segment("")


async def test_directory_backend_refuses_escaping_keys(tmp_path: Path) -> None:
    backend = DirectoryBackend(tmp_path / "root")
    for key in ("../x", "/abs", "a//b", ".tmp-x", "a/./b"):
        with pytest.raises(TransportError) as exc:
            await backend.put(key, b"x")
        assert exc.value.check == "key" and not exc.value.retryable
    assert not (tmp_path / "x").exists()


def test_registered_and_configured() -> None:
    assert load("transport", "directory") is DirectoryTransport
    assert load("transport", "s3") is S3Transport
    with pytest.raises(ConfigError):
        S3Transport(bucket="b", nonsense=1)
    with pytest.raises(ConfigError):
        S3Transport(bucket="b", part_mb=1)
    with pytest.raises(ConfigError):
        ObjectStoreConfig(fetch_concurrency=0)


async def test_an_owner_remembers_a_bounded_number_of_attempts(tmp_path: Path) -> None:
    """An owner process never cleans up (the coordinator does): what it keeps per attempt
    (posting order, V_payload keys) stays bounded while it sends attempt after attempt."""
    from dcr.adapters.transport.objstore.sender import KEEP_ATTEMPTS

    owner = directory_maker(tmp_path)()
    try:
        for attempt in range(1, KEEP_ATTEMPTS + 20):
            await owner.send(_key(attempt, "o0", 0), b"p")
        assert len({a for a, _ in owner._sender.turns}) <= KEEP_ATTEMPTS
        assert len(owner._sender.sent_keys) <= KEEP_ATTEMPTS
        assert owner.stats().payloads == KEEP_ATTEMPTS + 19
    finally:
        await owner.aclose()


def test_local_refit_over_a_directory_by_name() -> None:
    """``LocalRefit(transport="directory")``: the embedded default object store, a temporary
    directory removed when the refit closes; receivers end bit-exact."""
    from dcr import LocalRefit, StateDictSource, TrainLayout
    from dcr.adapters.loaders.sharded import ShardedServingLoader
    from dcr.delta.build import BuildConfig
    from dcr.local import RefitConfig
    from dcr.models.compare import module_bit_mismatches
    from dcr.models.families import random_state_dict, tiny_config
    from dcr.models.updates import perturb

    cfg = tiny_config("qwen3")
    w0 = random_state_dict(cfg, "qwen3", seed=3)
    ranks = [ShardedServingLoader.dense(cfg, "qwen3", w0, tp_size=2, tp_rank=r) for r in (0, 1)]
    source = StateDictSource(w0, layout=TrainLayout(tp=2, dp=1), family="qwen3", config=cfg)
    small = RefitConfig(build=BuildConfig(chunk_bytes=4096, bucket_bytes=8192))
    with LocalRefit(source, ranks, config=small, transport="directory") as refit:
        transport = refit.cluster.transport
        assert isinstance(transport, DirectoryTransport) and transport.path.exists()
        w1 = perturb(w0, rate=0.05, seed=4)
        report = refit.refit(w1)
        assert report.version == 1 and report.num_payloads > 2
        fresh = [ShardedServingLoader.dense(cfg, "qwen3", w1, tp_size=2, tp_rank=r)
                 for r in (0, 1)]  # fmt: skip
        for a, b in zip(ranks, fresh, strict=True):
            assert module_bit_mismatches(a.module, b.module) == []
        assert transport.fetch_stats().traffic.payloads == report.num_payloads
    assert not transport.path.exists()
