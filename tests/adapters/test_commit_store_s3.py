"""The S3 commit store: the conformance suite on moto and on a real SeaweedFS (with the rule that
a record deleted or expired after a commit is an error, never version 0), processes racing
compare-and-set, lost answers resolved by the nonce, both servers' failed-condition answers,
a damaged record, and the marker beside the record."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from typing import Any

import anyio
import pytest

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.commit.s3 import S3CommitStore
from dcr.adapters.registry import load
from dcr.errors import CommitStoreError, TransportError
from dcr.protocol.types import CommitOutcome, CommitRecord
from dcr.testing.commit_store import DurableCommitStoreTests, ManualClock
from dcr.testing.s3servers import S3Endpoint

G0 = CommitRecord(version=0, candidate="g0")


@pytest.fixture(scope="module")
def moto_bucket(moto_s3: S3Endpoint) -> str:
    return moto_s3.create_bucket()


@pytest.fixture(scope="module")
def seaweed_bucket(seaweed_s3: S3Endpoint) -> str:
    return seaweed_s3.create_bucket()


def _store(endpoint: S3Endpoint, bucket: str, key: str | None = None, **kw: Any) -> S3CommitStore:
    return S3CommitStore(
        bucket=bucket,
        key=key or f"commit-{uuid.uuid4().hex[:10]}.json",
        endpoint_url=endpoint.url,
        addressing_style="path",
        **kw,
    )


class _S3StoreTests(DurableCommitStoreTests):
    endpoint: S3Endpoint
    bucket: str

    def make_store(self, clock: ManualClock) -> CommitStore:
        return _store(self.endpoint, self.bucket, clock=clock, poll_s=0.001)

    async def lose_record(self, store: CommitStore) -> None:
        assert isinstance(store, S3CommitStore)
        await store._backend.delete([store.key])  # an expiry rule or a cleanup script

    def reopen(self, store: CommitStore, clock: ManualClock) -> CommitStore:
        assert isinstance(store, S3CommitStore)
        return _store(self.endpoint, self.bucket, key=store.key, clock=clock, poll_s=0.001)


class TestS3StoreOnMoto(_S3StoreTests):
    max_examples, steps = 20, 20

    @pytest.fixture(autouse=True)
    def _server(self, moto_s3: S3Endpoint, moto_bucket: str) -> None:
        self.endpoint, self.bucket = moto_s3, moto_bucket


class TestS3StoreOnSeaweedfs(_S3StoreTests):
    max_examples, steps = 8, 15

    @pytest.fixture(autouse=True)
    def _server(self, seaweed_s3: S3Endpoint, seaweed_bucket: str) -> None:
        self.endpoint, self.bucket = seaweed_s3, seaweed_bucket


def _race(url: str, bucket: str, key: str, tag: int, start: Any, results: Any) -> None:
    """A child process: one compare-and-set from the same expected record."""

    async def main() -> CommitOutcome:
        store = S3CommitStore(bucket=bucket, key=key, endpoint_url=url, addressing_style="path")
        try:
            state = await store.read()
            start.wait()
            return await store.compare_and_set(
                epoch=state.epoch, attempt=7, expected=G0,
                new=CommitRecord(version=1, candidate=f"g7-{tag}"), deadline=1e12,
            )  # fmt: skip
        finally:
            await store.close()

    results.put((tag, anyio.run(main).value))


@pytest.mark.parametrize(("server", "racers"), [("moto", 6), ("seaweedfs", 3)])
def test_compare_and_set_has_one_winner_across_processes(
    server: str, racers: int, request: pytest.FixtureRequest
) -> None:
    endpoint = request.getfixturevalue("moto_s3" if server == "moto" else "seaweed_s3")
    bucket = request.getfixturevalue("moto_bucket" if server == "moto" else "seaweed_bucket")
    key = f"race-{uuid.uuid4().hex[:8]}.json"

    async def setup() -> None:
        store = _store(endpoint, bucket, key)
        epoch = await store.claim()
        await store.register(epoch=epoch, attempt=7, base=G0)
        await store.close()

    anyio.run(setup)
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_race, args=(endpoint.url, bucket, key, tag, start, results))
        for tag in range(racers)
    ]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    outcomes = dict(results.get(timeout=5) for _ in procs)
    winners = [tag for tag, o in outcomes.items() if o == "succeeded"]
    assert len(winners) == 1, outcomes
    assert all(o == "conflict" for tag, o in outcomes.items() if tag != winners[0])

    async def check() -> CommitRecord:
        store = _store(endpoint, bucket, key)
        try:
            return (await store.read()).record
        finally:
            await store.close()

    assert anyio.run(check) == CommitRecord(version=1, candidate=f"g7-{winners[0]}")


class _SlowObjects:
    """One-key object store behind :class:`S3Backend`'s commit-store calls, with atomic
    conditional writes that take a while; it records how many were in flight at once."""

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.etag = ""
        self.writes = self.in_flight = self.peak = 0

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        return None if self.data is None else (self.data, self.etag)

    async def get(self, key: str) -> bytes | None:
        return None  # the marker beside the record: not written yet

    async def put(self, key: str, data: bytes) -> None:
        pass  # the marker

    def describe(self) -> str:
        return "slow objects"

    async def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await anyio.sleep(0.01)
            if (etag is None) != (self.data is None) or (etag is not None and etag != self.etag):
                return None
            self.writes += 1
            self.data, self.etag = data, f'"{self.writes}"'
            return self.etag
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        pass


def test_one_store_sends_one_conditional_write_at_a_time() -> None:
    """Transactions started at once on one store object (a coordinator's lease renewal
    beside its commit) run one at a time: SeaweedFS lets several conditional PUTs with one
    ETag succeed when they arrive together (its If-Match check and write are not atomic),
    so a store never sends it two at once.  Each transaction still lands exactly once."""
    objects = _SlowObjects()
    store = S3CommitStore(bucket="b", key="commit.json", endpoint_url="http://127.0.0.1:9")
    store._backend = objects  # type: ignore[assignment]
    rounds, racers = 5, 3

    async def main() -> tuple[int, int]:
        epoch = await store.claim()
        before = (await store.read()).revision
        for _ in range(rounds):
            async with anyio.create_task_group() as tg:
                for _ in range(racers):
                    tg.start_soon(lambda: store.renew(epoch=epoch, lease_s=60.0))
        return before, (await store.read()).revision

    before, after = anyio.run(main)
    assert objects.peak == 1
    assert after - before == rounds * racers
    # the lock belongs to the event loop it was made in: a later run makes its own
    anyio.run(main)
    assert objects.peak == 1


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_failed_conditions_are_lost_races(server: str, request: pytest.FixtureRequest) -> None:
    """If-Match on a missing object (404 on moto, 412 on SeaweedFS), a stale ETag and
    If-None-Match on an existing object are all answered as a failed condition."""
    endpoint = request.getfixturevalue("moto_s3" if server == "moto" else "seaweed_s3")
    bucket = request.getfixturevalue("moto_bucket" if server == "moto" else "seaweed_bucket")

    async def main() -> None:
        store = _store(endpoint, bucket)
        b = store._backend
        try:
            key = f"probe-{uuid.uuid4().hex[:8]}"
            assert await b.put_if(key, b"a", etag='"0123456789abcdef0123456789abcdef"') is None
            first = await b.put_if(key, b"a", etag=None)
            assert first is not None
            assert await b.put_if(key, b"b", etag=None) is None
            second = await b.put_if(key, b"b", etag=first)
            assert second is not None and second != first
            assert await b.put_if(key, b"c", etag=first) is None  # a stale writer loses
            # The same state written twice gets two ETags (the nonce): a writer holding the
            # first cannot replace the second.
            await store.claim()
            await store._transact(lambda s: s)
            one = await b.read_versioned(store.key)
            await store._transact(lambda s: s)
            two = await b.read_versioned(store.key)
            assert one is not None and two is not None and one[1] != two[1]
            assert await b.put_if(store.key, b"stale", etag=one[1]) is None
        finally:
            await store.close()

    anyio.run(main)


def test_a_lost_answer_is_resolved_by_the_nonce(moto_s3: S3Endpoint, moto_bucket: str) -> None:
    """A write that landed but whose answer was lost counts as done; one that did not land
    is a retryable error, and a compare-and-set in that case is UNKNOWN."""

    async def main() -> None:
        store = _store(moto_s3, moto_bucket, clock=ManualClock())
        b = store._backend
        real = b.put_if
        mode = {"landed": True}

        async def lossy(key: str, data: bytes, *, etag: str | None) -> str | None:
            if mode["landed"]:
                await real(key, data, etag=etag)
            raise TransportError("connection reset", retryable=True, check="connection")

        try:
            epoch = await store.claim()
            b.put_if = lossy  # type: ignore[method-assign]
            await store.register(epoch=epoch, attempt=1, base=G0)  # landed: no error
            assert (await store.read()).attempt == 1
            mode["landed"] = False
            with pytest.raises(CommitStoreError) as exc:
                await store.register(epoch=epoch, attempt=2, base=G0)
            assert exc.value.retryable
            outcome = await store.compare_and_set(
                epoch=epoch, attempt=1, expected=G0,
                new=CommitRecord(version=1, candidate="g1"), deadline=2e9,
            )  # fmt: skip
            assert outcome is CommitOutcome.UNKNOWN
            b.put_if = real  # type: ignore[method-assign]
            assert (await store.read()).record == G0
        finally:
            await store.close()

    anyio.run(main)


def test_a_damaged_record_is_refused(moto_s3: S3Endpoint, moto_bucket: str) -> None:
    async def main() -> None:
        store = _store(moto_s3, moto_bucket)
        try:
            await store._backend.put(store.key, b'{"format": 1, "version": "one"}')
            with pytest.raises(CommitStoreError) as exc:
                await store.read()
            assert exc.value.check == "record" and not exc.value.retryable
        finally:
            await store.close()

    anyio.run(main)


def test_registered() -> None:
    assert load("commit_store", "s3") is S3CommitStore


def test_the_marker_follows_the_record_and_names_the_last_commit(
    moto_s3: S3Endpoint, moto_bucket: str
) -> None:
    """The marker is written after the first write and each commit; the error of a lost
    record names its address, the last version committed and the reset command.  A record
    lost while a coordinator runs stops its writes too (no epoch is handed out again)."""

    async def main() -> None:
        clock = ManualClock()
        store = _store(moto_s3, moto_bucket, clock=clock)
        b = store._backend
        try:
            assert await b.get(store.marker_key) is None
            epoch = await store.claim(lease_s=60.0)
            assert await b.get(store.marker_key) is not None
            await store.register(epoch=epoch, attempt=4, base=G0)
            v1 = CommitRecord(version=1, candidate="g4")
            outcome = await store.compare_and_set(
                epoch=epoch, attempt=4, expected=G0, new=v1, deadline=clock.now + 30
            )
            assert outcome is CommitOutcome.SUCCEEDED
            await b.delete([store.key])
            with pytest.raises(CommitStoreError) as exc:
                await store.renew(epoch=epoch, lease_s=60.0)
            message = str(exc.value)
            assert exc.value.check == "missing" and store.describe() in message
            assert "version 1 (g4)" in message and "dcr commit-store reset" in message
            assert await b.read_versioned(store.key) is None  # nothing written back
            assert await store.reset() == [f"{b.describe()}/{store.marker_key}"]
            assert await b.get(store.marker_key) is None
        finally:
            await store.close()

    anyio.run(main)
