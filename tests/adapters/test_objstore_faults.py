"""Storage faults in a refit over S3 (moto) with the commit record on S3: throttled uploads,
connection resets, a truncated object, a missing manifest entry and an upload that lands
after its attempt was stopped.  A fault the storage retries absorb leaves the attempt alone;
every other one fails the attempt, and the overwrite retry commits.  Every receiver ends with
the bits of a dense load (integer views), and the commit record holds the new version."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dcr import LocalRefit, StateDictSource, TrainLayout
from dcr.adapters.commit.s3 import S3CommitStore
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.transport.objstore import ObjectStoreConfig, ObjectStoreTransport
from dcr.adapters.transport.s3 import S3Backend, S3Options
from dcr.delta.build import BuildConfig
from dcr.local import RefitConfig
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol.types import CommitRecord
from dcr.testing.s3servers import S3Endpoint
from dcr.testing.storage_faults import FaultyBackend, StorageFaults

FAMILY = "llama"
SERVING = (1, 2)
SMALL = BuildConfig(chunk_bytes=4096, bucket_bytes=8192)  # several payloads per owner
STORAGE = ObjectStoreConfig(
    poll_s=0.02, arrival_grace_s=1.0, retries=4, backoff_s=0.01, backoff_max_s=0.05
)
"""Four tries per storage operation; a payload missing at flush fails within a second."""
FOREVER = 10**6


@dataclasses.dataclass
class World:
    cfg: dict[str, Any]
    w0: dict[str, Any]
    ranks: list[ShardedServingLoader]
    refit: LocalRefit
    transport: ObjectStoreTransport
    faulty: FaultyBackend
    store: S3CommitStore

    def assert_exact(self, w: dict[str, Any]) -> None:
        fresh = [
            ShardedServingLoader.dense(self.cfg, FAMILY, w, tp_size=tp, tp_rank=r)
            for tp in SERVING
            for r in range(tp)
        ]
        for i, (a, b) in enumerate(zip(self.ranks, fresh, strict=True)):
            assert module_bit_mismatches(a.module, b.module) == [], f"rank {i}"

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a coroutine function on the refit's event loop (where the clients live)."""
        return self.refit._portal.call(fn, *args)


@pytest.fixture(scope="module")
def bucket(moto_s3: S3Endpoint) -> str:
    return moto_s3.create_bucket()


@pytest.fixture
def world(moto_s3: S3Endpoint, bucket: str, request: pytest.FixtureRequest) -> Iterator[World]:
    plan: StorageFaults = request.param
    cfg = tiny_config(FAMILY)
    w0 = random_state_dict(cfg, FAMILY, seed=0)
    ranks = [
        ShardedServingLoader.dense(cfg, FAMILY, w0, tp_size=tp, tp_rank=r)
        for tp in SERVING
        for r in range(tp)
    ]
    prefix = f"faults-{uuid.uuid4().hex[:8]}"
    s3 = S3Options(bucket=bucket, prefix=prefix, endpoint_url=moto_s3.url, addressing_style="path")
    faulty = FaultyBackend(S3Backend(s3), plan)
    transport = ObjectStoreTransport(faulty, STORAGE)
    store = S3CommitStore(bucket=bucket, prefix=prefix, endpoint_url=moto_s3.url,
                          addressing_style="path")  # fmt: skip
    source = StateDictSource(w0, layout=TrainLayout(tp=2, dp=2), family=FAMILY, config=cfg)
    refit = LocalRefit(
        source, ranks, config=RefitConfig(build=SMALL), transport=transport, store=store
    )
    world = World(cfg, w0, ranks, refit, transport, faulty, store)
    try:
        yield world
    finally:
        try:
            world.call(transport.aclose)
            world.call(store.close)
        finally:
            refit.close()


def refit_once(world: World, modes: list[str], *, clean: bool = True) -> None:
    """One refit: the attempts it took, bit-exact receivers, the new record committed, and
    (``clean``) nothing of any attempt left in storage."""
    w1 = perturb(world.w0, rate=0.05, seed=1)
    report = world.refit.refit(w1)
    assert [a.mode.value for a in report.attempts] == modes
    world.assert_exact(w1)
    record = world.call(world.store.read).record
    assert record == world.refit.record and record.version == 1
    assert record != CommitRecord(version=0, candidate="g0")
    if clean:
        assert world.call(world.faulty.inner.list, "payload/") == []


@pytest.mark.parametrize("world", [StorageFaults(throttle=3)], indirect=True)
def test_throttled_uploads_are_retried(world: World) -> None:
    """Three 503 SlowDown answers: each upload is tried again; the attempt commits."""
    refit_once(world, ["mixed"])
    assert world.faulty.log.throttled == 3
    assert world.transport.fetch_stats().retried >= 3


@pytest.mark.parametrize("world", [StorageFaults(throttle=FOREVER)], indirect=True)
def test_throttling_beyond_the_retries_fails_the_attempt(world: World) -> None:
    """Every upload of the first attempt is throttled past its last try: the sends fail,
    the attempt fails, and the overwrite retry commits."""
    refit_once(world, ["mixed", "overwrite"])
    assert world.faulty.log.throttled >= STORAGE.retries


@pytest.mark.parametrize("world", [StorageFaults(reset=3)], indirect=True)
def test_connection_resets_are_retried(world: World) -> None:
    refit_once(world, ["mixed"])
    assert world.faulty.log.reset == 3


@pytest.mark.parametrize("world", [StorageFaults(reset=FOREVER)], indirect=True)
def test_fetches_that_keep_failing_fail_the_arrival_check(world: World) -> None:
    """No payload of the first attempt can be fetched: the arrival check at flush fails it
    within the arrival grace, and the overwrite retry commits."""
    refit_once(world, ["mixed", "overwrite"])
    assert world.transport.fetch_stats().errors >= 1


@pytest.mark.parametrize("world", [StorageFaults(truncate=1)], indirect=True)
def test_a_truncated_object_fails_the_attempt(world: World) -> None:
    """A payload stored with half its bytes: the length check against the manifest fetches
    it again, then hands it over as stored; the receivers' decoder refuses it at once."""
    refit_once(world, ["mixed", "overwrite"])
    log = world.faulty.log
    assert len(log.truncated) == 1
    assert log.fetched.count(log.truncated[0]) == STORAGE.retries
    assert world.transport.fetch_stats().damaged == 1


@pytest.mark.parametrize("world", [StorageFaults(drop_entry=1)], indirect=True)
def test_a_missing_manifest_entry_fails_the_arrival_check(world: World) -> None:
    refit_once(world, ["mixed", "overwrite"])
    assert len(world.faulty.log.dropped) == 1


@pytest.mark.parametrize("world", [StorageFaults(drop_entry=1, late_upload=2)], indirect=True)
def test_an_upload_that_lands_after_the_stop_is_never_fetched(world: World) -> None:
    """The first attempt fails (a lost manifest entry); after it was stopped and cleaned up, a
    straggler writes two of its payloads and their entries again.  The tombstone keeps every
    node from fetching them, the retry commits, a later refit is clean, and once the
    tombstone expires a cleanup sweeps what the straggler left."""
    refit_once(world, ["mixed", "overwrite"], clean=False)
    log = world.faulty.log
    world.call(world.faulty.settled)
    assert len(log.late) >= 2 and log.landed_at is not None
    assert not set(log.late) & set(log.fetched[log.landed_at :])
    w2 = perturb(perturb(world.w0, rate=0.05, seed=1), rate=0.05, seed=2)
    report = world.refit.refit(w2)
    assert [a.mode.value for a in report.attempts] == ["mixed"]
    world.assert_exact(w2)
    assert not set(log.late) & set(log.fetched[log.landed_at :])
    struck = f"payload/{log.attempt:020d}/"
    assert world.call(world.faulty.inner.list, struck)  # still there: the tombstone is young
    world.transport.config = dataclasses.replace(STORAGE, tombstone_ttl_s=0.0)
    world.call(world.transport.cleanup, FOREVER)
    assert world.call(world.faulty.inner.list, struck) == []
