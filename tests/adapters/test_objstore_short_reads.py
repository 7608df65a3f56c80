"""A manifest entry read short (fewer bytes than the listing shows, no error: a cut response
that still looked complete) is read again, like a short payload read, and decided on only from
a complete read: its payload is fetched and the attempt commits without waiting out the
arrival grace.  The faults are struck behind the backend interface, over moto's S3."""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Sequence

import anyio
import pytest

from dcr import LocalRefit, StateDictSource, TrainLayout
from dcr.adapters.commit.s3 import S3CommitStore
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.transport.base import Delivery
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore import (
    ObjectBackend,
    ObjectInfo,
    ObjectStoreConfig,
    ObjectStoreTransport,
)
from dcr.adapters.transport.s3 import S3Backend, S3Options
from dcr.delta.build import BuildConfig
from dcr.local import LOCAL_TIMEOUTS, RefitConfig
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol.types import CommitRecord, PayloadKey
from dcr.testing.s3servers import S3Endpoint

STORAGE = ObjectStoreConfig(
    poll_s=0.02, arrival_grace_s=600.0, retries=4, backoff_s=0.01, backoff_max_s=0.05
)
"""An arrival grace far longer than any test here may take: an entry whose payload is never
fetched would hold its attempt for ten minutes."""


FIRST = ".0000000000"
"""How the manifest entry key of a writer's first send of an attempt and owner ends."""


class ShortEntryReads(ObjectBackend):
    """``inner``, whose first ``cuts`` GETs of each manifest entry whose key ends with
    ``FIRST`` (each owner's first payload) return half the object's bytes and no error, in
    the first attempt whose entries it reads (the *struck* one; later attempts run clean)."""

    def __init__(self, inner: ObjectBackend, *, cuts: int = 1) -> None:
        self.inner = inner
        self.cuts = cuts
        self.reads: Counter[str] = Counter()
        """GETs of each manifest entry."""
        self.cut: Counter[str] = Counter()
        """GETs of each manifest entry that were cut short."""
        self.struck: str | None = None
        """The struck attempt's segment of the keys."""

    def describe(self) -> str:
        return f"short-reading {self.inner.describe()}"

    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        data = await self.inner.get(key, link=link)
        if data is None or not (key.startswith("manifest/") and "/e/" in key):
            return data
        self.reads[key] += 1
        attempt = key.split("/")[1]
        if self.struck is None:
            self.struck = attempt
        if attempt == self.struck and key.endswith(FIRST) and self.cut[key] < self.cuts:
            self.cut[key] += 1
            return data[: len(data) // 2]
        return data

    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        await self.inner.put(key, data, link=link)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def abort_uploads(self, prefix: str) -> None:
        await self.inner.abort_uploads(prefix)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture(scope="module")
def bucket(moto_s3: S3Endpoint) -> str:
    return moto_s3.create_bucket()


def _s3(endpoint: S3Endpoint, bucket: str, prefix: str) -> S3Backend:
    return S3Backend(
        S3Options(bucket=bucket, prefix=prefix, endpoint_url=endpoint.url, addressing_style="path")
    )


@pytest.mark.parametrize("cuts", [1, STORAGE.retries + 1])
def test_a_short_manifest_read_is_read_again(moto_s3: S3Endpoint, bucket: str, cuts: int) -> None:
    """Three payloads of one owner; the node's reads of the first one's manifest entry come
    back half long ``cuts`` times.  Once: the entry is read again at once.  More often than one
    scan tries (``retries`` reads): the next scan reads it again, and the later entries of
    its stream wait for it.  Either way every payload reaches the receiver, in the order it
    was sent, and no entry is counted bad."""
    prefix = f"short-{uuid.uuid4().hex[:8]}"
    payloads = [bytes([n]) * (1000 + n) for n in range(3)]

    async def main() -> tuple[list[Delivery], ShortEntryReads, ObjectStoreTransport]:
        sender = ObjectStoreTransport(_s3(moto_s3, bucket, prefix), STORAGE)
        faulty = ShortEntryReads(_s3(moto_s3, bucket, prefix), cuts=cuts)
        node = ObjectStoreTransport(faulty, STORAGE)
        got: list[Delivery] = []
        try:
            for n, data in enumerate(payloads):
                await sender.send(PayloadKey(attempt=1, owner="o0", payload_id=n), data)
            with anyio.fail_after(120):  # a generous deadline, far below the arrival grace
                async for delivery in node.subscribe("r0"):
                    got.append(delivery)
                    await node.taken("r0", delivery.key)
                    if len(got) == len(payloads):
                        break
        finally:
            await sender.aclose()
            await node.aclose()
        return got, faulty, node

    got, faulty, node = anyio.run(main, backend="asyncio")
    assert [d.data for d in got] == payloads
    assert [d.key.payload_id for d in got] == [0, 1, 2]
    assert len(faulty.cut) == 1 and list(faulty.cut.values()) == [cuts]
    (struck,) = faulty.cut
    assert faulty.reads[struck] == cuts + 1  # read whole exactly once, then never again
    # The later entries of its stream wait for it (read again with it at the next scan).
    later = 1 if cuts < STORAGE.retries else 2
    assert all(n == later for key, n in faulty.reads.items() if key != struck)
    stats = node.fetch_stats()
    assert stats.bad_entries == 0 and stats.retried >= min(cuts, STORAGE.retries - 1)
    assert stats.errors == (1 if cuts >= STORAGE.retries else 0)


def test_a_refit_commits_past_a_short_manifest_read(moto_s3: S3Endpoint, bucket: str) -> None:
    """A refit over S3 whose node reads the manifest entry of each owner's first payload
    short once: each is read again, its payload fetched, and the first attempt commits -- no
    overwrite retry, though the arrival grace (600 s) is far longer than the arrival deadline
    (90 s) that would fail an attempt missing a payload.  Every receiver holds the bits of a
    dense load."""
    family, serving = "llama", (1, 2)
    cfg = tiny_config(family)
    w0 = random_state_dict(cfg, family, seed=0)
    ranks = [
        ShardedServingLoader.dense(cfg, family, w0, tp_size=tp, tp_rank=r)
        for tp in serving
        for r in range(tp)
    ]
    prefix = f"short-refit-{uuid.uuid4().hex[:8]}"
    faulty = ShortEntryReads(_s3(moto_s3, bucket, prefix))
    transport = ObjectStoreTransport(faulty, STORAGE)
    store = S3CommitStore(bucket=bucket, prefix=prefix, endpoint_url=moto_s3.url,
                          addressing_style="path")  # fmt: skip
    source = StateDictSource(w0, layout=TrainLayout(tp=2, dp=2), family=family, config=cfg)
    # Asynchronous RL: the coordinator's arrival deadline covers streaming, so an attempt
    # missing a payload fails after 90 s instead of the receivers' 600 s arrival grace.
    timeouts = dataclasses.replace(LOCAL_TIMEOUTS, arrival_s=90.0, flush_s=90.0)
    build = BuildConfig(chunk_bytes=4096, bucket_bytes=8192)
    config = RefitConfig(build=build, timeouts=timeouts, sync=False)
    refit = LocalRefit(source, ranks, config=config, transport=transport, store=store)
    try:
        w1 = perturb(w0, rate=0.05, seed=1)
        report = refit.refit(w1)
        assert [a.mode.value for a in report.attempts] == ["mixed"]
        assert faulty.cut and all(n == 1 for n in faulty.cut.values())
        assert all(faulty.reads[key] == 2 for key in faulty.cut)
        assert transport.fetch_stats().retried >= len(faulty.cut)
        assert transport.fetch_stats().bad_entries == 0
        record = refit._portal.call(store.read).record
        assert record == refit.record and record.version == 1
        assert record != CommitRecord(version=0, candidate="g0")
        fresh = [
            ShardedServingLoader.dense(cfg, family, w1, tp_size=tp, tp_rank=r)
            for tp in serving
            for r in range(tp)
        ]
        for i, (a, b) in enumerate(zip(ranks, fresh, strict=True)):
            assert module_bit_mismatches(a.module, b.module) == [], f"rank {i}"
    finally:
        try:
            refit._portal.call(transport.aclose)
            refit._portal.call(store.close)
        finally:
            refit.close()
