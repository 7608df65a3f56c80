"""Sealed manifest entries of the object-storage transport (``ObjectStoreConfig.fleet_secret``):
the conformance suite with seals on, the documented seal on every entry, and entries a node
refuses before it trusts them -- written with raw S3 puts by someone without the secret,
sealed under another secret, moved to another key, or unsealed."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
import blake3
import msgspec
import pytest
from test_transport_objstore import FAST, ObjectStoreHarness, _collect, _until

from dcr.adapters.context import AdapterContext
from dcr.adapters.transport.base import Delivery
from dcr.adapters.transport.directory import DirectoryTransport
from dcr.adapters.transport.objstore import (
    ObjectStoreConfig,
    ObjectStoreTransport,
    fleet_settings,
    manifest_key,
    payload_key,
)
from dcr.adapters.transport.objstore.layout import ManifestEntry, decode_entry, encode_entry
from dcr.adapters.transport.s3 import S3Transport
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.testing.s3servers import S3Endpoint
from dcr.testing.transport import TransportHarness, TransportTests
from dcr.wire.seal import seal_keys

pytestmark = pytest.mark.anyio

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))
KM = seal_keys(SECRET).manifest
Make = Callable[[], ObjectStoreTransport]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def sealed_bucket(moto_s3: S3Endpoint) -> str:
    return moto_s3.create_bucket()


def s3_transport(endpoint: S3Endpoint, bucket: str, prefix: str, **settings: object) -> Make:
    return lambda: S3Transport(  # type: ignore[arg-type]
        bucket=bucket, prefix=prefix, endpoint_url=endpoint.url, addressing_style="path",
        **{**FAST, **settings},
    )  # fmt: skip


@pytest.fixture(params=["directory", "moto"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    if request.param == "directory":
        root = tmp_path / "objects"
        return lambda: DirectoryTransport(root, fsync=False, fleet_secret=SECRET, **FAST)  # type: ignore[arg-type]
    endpoint = request.getfixturevalue("moto_s3")
    bucket = request.getfixturevalue("sealed_bucket")
    return s3_transport(endpoint, bucket, f"t-{uuid.uuid4().hex[:8]}", fleet_secret=SECRET)


class TestSealedObjectStore(TransportTests):
    """The conformance suite with sealed manifest entries: sealing changes nothing a
    transport promises, and no genuine entry is ever refused."""

    credit = False  # as TestObjectStoreTransport: storage decouples the sides
    keeps_sent_at_cleanup = False  # as TestObjectStoreTransport: cleanup deletes at once
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


# -- the seal --------------------------------------------------------------------------------


def _entry(
    attempt: int = 5, owner: str = "o0", payload_id: int = 0, size: int = 3
) -> ManifestEntry:
    return ManifestEntry(
        format=1, attempt=attempt, owner=owner, payload_id=payload_id, size=size, to=None
    )


def test_an_entry_is_its_json_and_the_documented_seal() -> None:
    key = manifest_key(5, "o0", "0123456789abcdef", 0)
    raw = encode_entry(_entry(), key, KM)
    body, seal = raw[:-16], raw[-16:]
    assert body == msgspec.json.encode(_entry())
    name = key.encode()
    assert seal == blake3.blake3(struct.pack("<I", len(name)) + name + body, key=KM).digest()[:16]
    assert decode_entry(raw, key, KM) == _entry()
    assert encode_entry(_entry(), key, None) == body  # without a secret: plain JSON


@pytest.mark.parametrize(
    "case", ["other-secret", "other-key", "unsealed", "flipped", "short", "payload-key"]
)
def test_decode_entry_refuses_what_its_seal_does_not_vouch_for(case: str) -> None:
    key = manifest_key(5, "o0", "0123456789abcdef", 0)
    raw = {
        "other-secret": encode_entry(_entry(), key, seal_keys(OTHER).manifest),
        "other-key": encode_entry(_entry(), manifest_key(5, "o0", "0123456789abcdef", 1), KM),
        "unsealed": encode_entry(_entry(), key, None),
        "flipped": bytes([encode_entry(_entry(), key, KM)[0] ^ 1])
        + encode_entry(_entry(), key, KM)[1:],
        "short": encode_entry(_entry(), key, KM)[-16:],
        "payload-key": encode_entry(_entry(), key, seal_keys(SECRET).payload),
    }[case]
    with pytest.raises(TransportError) as err:
        decode_entry(raw, key, KM)
    assert (err.value.check, err.value.retryable) == ("seal", False)


def test_a_reader_without_the_secret_does_not_take_sealed_entries() -> None:
    key = manifest_key(5, "o0", "0123456789abcdef", 0)
    with pytest.raises(TransportError, match="no fleet_secret") as err:
        decode_entry(encode_entry(_entry(), key, KM), key, None)
    assert err.value.check == "manifest"


def test_the_secret_is_a_32_byte_setting_kept_out_of_reprs_and_fleet_files(tmp_path: Path) -> None:
    config = ObjectStoreConfig(fleet_secret=SECRET)
    assert config.manifest_seal_key == KM
    assert SECRET.hex() not in repr(config) and "fleet_secret" not in repr(config)
    assert ObjectStoreConfig().manifest_seal_key is None
    with pytest.raises(ConfigError, match="32 bytes"):
        ObjectStoreConfig(fleet_secret=SECRET[:16])
    with pytest.raises(ConfigError, match="32 bytes"):
        ObjectStoreConfig(fleet_secret=SECRET.hex())  # type: ignore[arg-type]
    context = AdapterContext(section="transport", base_dir=tmp_path, run_dir=tmp_path)
    assert fleet_settings({"poll_s": 0.5}, context) == {"poll_s": 0.5}
    with pytest.raises(ConfigError, match="fleet_secret"):
        fleet_settings({"fleet_secret": SECRET.hex()}, context)


# -- forged entries in the bucket ------------------------------------------------------------


async def test_forged_manifest_entries_put_into_the_bucket_are_refused(
    moto_s3: S3Endpoint, sealed_bucket: str
) -> None:
    """Someone with write access to the bucket and no secret puts a payload object and its
    manifest entry with raw S3 PUTs (plain JSON, a guessed seal, a seal under another
    secret, a genuine entry copied to another writer's key pointing at its forged payload):
    the node refuses every entry before it fetches anything it names, counts them, and keeps
    delivering the genuine payloads."""
    prefix = "sealed-forgery"
    make = s3_transport(moto_s3, sealed_bucket, prefix, fleet_secret=SECRET)
    owner, node = make(), make()
    raw = moto_s3.client()
    forged_payload = b"forged weights"

    def put(key: str, body: bytes) -> None:
        raw.put_object(Bucket=sealed_bucket, Key=f"{prefix}/{key}", Body=body)

    got: list[Delivery] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, node, "r0", got)
            genuine = PayloadKey(attempt=5, owner="o0", payload_id=0)
            await owner.send(genuine, b"genuine")
            await _until(lambda: len(got) == 1, "the genuine payload")
            (entry_key,) = [
                o["Key"][len(prefix) + 1 :]
                for o in raw.list_objects_v2(Bucket=sealed_bucket, Prefix=f"{prefix}/manifest/")[
                    "Contents"
                ]
            ]
            genuine_entry = raw.get_object(Bucket=sealed_bucket, Key=f"{prefix}/{entry_key}")[
                "Body"
            ].read()
            forged = msgspec.json.encode(_entry(payload_id=1, size=len(forged_payload)))
            cases = {
                "aaaaaaaaaaaaaaa1": forged,  # plain JSON
                "aaaaaaaaaaaaaaa2": forged + bytes(16),  # a guessed seal
                "aaaaaaaaaaaaaaa3": encode_entry(
                    _entry(payload_id=1, size=len(forged_payload)),
                    manifest_key(5, "o0", "aaaaaaaaaaaaaaa3", 0),
                    seal_keys(OTHER).manifest,
                ),
                "aaaaaaaaaaaaaaa4": genuine_entry[:-16].replace(b'"size":7', b'"size":14')
                + genuine_entry[-16:],
                "aaaaaaaaaaaaaaa5": genuine_entry,  # moved: its seal names its own key
            }
            for writer, body in cases.items():
                put(payload_key(5, "o0", writer, 0), forged_payload)
                put(manifest_key(5, "o0", writer, 0), body)
            await _until(lambda: node.fetch_stats().bad_entries >= len(cases), "the forged entries")
            await owner.send(PayloadKey(attempt=5, owner="o0", payload_id=1), b"genuine 1")
            await _until(lambda: len(got) == 2, "the next genuine payload")
            await anyio.sleep(3 * FAST["poll_s"])  # several more scans
            tg.cancel_scope.cancel()
    finally:
        await owner.aclose()
        await node.aclose()
    assert [d.data for d in got] == [b"genuine", b"genuine 1"]
    stats = node.fetch_stats()
    assert stats.bad_entries == len(cases)
    assert "not sealed with this fleet's secret" in stats.last_error
    assert stats.traffic.cross_bytes == len(b"genuine") + len(b"genuine 1")  # nothing forged


async def test_a_sealed_node_refuses_an_unsealed_writer_and_the_reverse(tmp_path: Path) -> None:
    """Every process of a fleet has the secret, or none has: mixing them delivers nothing."""

    def make(root: Path, secret: bytes | None) -> ObjectStoreTransport:
        return DirectoryTransport(root, fsync=False, fleet_secret=secret, **FAST)  # type: ignore[arg-type]

    for attempt, writer_secret, reader_secret in ((7, None, SECRET), (8, SECRET, None)):
        root = tmp_path / f"objects-{attempt}"
        owner, node = make(root, writer_secret), make(root, reader_secret)
        got: list[Delivery] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_collect, node, "r0", got)
                await owner.send(PayloadKey(attempt=attempt, owner="o0", payload_id=0), b"x")
                await _until(lambda n=node: n.fetch_stats().bad_entries >= 1, "the refusal")
                tg.cancel_scope.cancel()
        finally:
            await owner.aclose()
            await node.aclose()
        assert got == []
        assert node.fetch_stats().traffic.cross_bytes == 0
