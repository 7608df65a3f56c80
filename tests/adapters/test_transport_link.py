"""The emulated link: bytes per second within bounds derived from the configured rate (the
lower bound is exact up to the burst allowance; the upper bound is generous, for a loaded
machine), shared between concurrent transfers, and applied to the object-store transport's
uploads and fetches.  Also: S3 errors as the transport sees them, from real vendor
exceptions and real broken connections."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from dcr.adapters.transport.base import Delivery
from dcr.adapters.transport.directory import DirectoryTransport
from dcr.adapters.transport.link import CHUNK, LinkLimit
from dcr.adapters.transport.s3 import S3Backend, S3Options, S3Transport, convert_error
from dcr.errors import ConfigError, TransportError
from dcr.protocol.types import PayloadKey
from dcr.testing.s3servers import S3Endpoint

pytestmark = pytest.mark.anyio

RATE_GBPS = 0.08
"""10 MB/s: a transfer of 2 MB takes at least 0.2 s."""
MB = 10**6
SLACK_S = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _within(elapsed: float, nbytes: int, link: LinkLimit) -> None:
    rate = link.bytes_per_s
    assert rate is not None
    least = nbytes / rate - link.burst_s
    assert least <= elapsed <= 10 * least + SLACK_S, (elapsed, least)


async def test_one_transfer_is_paced() -> None:
    link = LinkLimit(RATE_GBPS)
    t0 = time.monotonic()
    await link.pace(2 * MB)
    _within(time.monotonic() - t0, 2 * MB, link)
    assert link.stats().bytes == 2 * MB and link.stats().waited_s > 0


async def test_concurrent_transfers_share_the_rate() -> None:
    """Three transfers of 3 MB at once: together they take the link time of 9 MB, and as
    they interleave in 1 MiB pieces, none finishes before the last two pieces' time."""
    link = LinkLimit(2 * RATE_GBPS)
    t0 = time.monotonic()
    done: list[float] = []

    async def transfer() -> None:
        await link.pace(3 * MB)
        done.append(time.monotonic() - t0)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(transfer)
    _within(max(done), 9 * MB, link)
    rate = link.bytes_per_s
    assert rate is not None
    assert min(done) >= (9 * MB - 2 * CHUNK) / rate - link.burst_s


async def test_unlimited_link_only_counts() -> None:
    for link in (LinkLimit(None), LinkLimit(0)):
        t0 = time.monotonic()
        await link.pace(10**9)
        assert time.monotonic() - t0 < SLACK_S
        assert link.bytes_per_s is None and link.stats().bytes == 10**9
    with pytest.raises(ConfigError):
        LinkLimit(-1.0)


async def test_transport_uploads_and_fetches_go_through_the_link(tmp_path: Path) -> None:
    """An owner's upload and a node's fetch of a 2 MB payload each take their link time."""
    owner = DirectoryTransport(tmp_path, fsync=False, poll_s=0.02, link_gbps=RATE_GBPS)
    node = DirectoryTransport(tmp_path, fsync=False, poll_s=0.02, link_gbps=RATE_GBPS)
    try:
        got: list[tuple[float, Delivery]] = []

        async def collect() -> None:
            async for d in node.subscribe("r0"):
                got.append((time.monotonic(), d))

        async with anyio.create_task_group() as tg:
            tg.start_soon(collect)
            data = b"\x5a" * (2 * MB)
            t0 = time.monotonic()
            await owner.send(PayloadKey(attempt=1, owner="o0", payload_id=0), data)
            sent = time.monotonic()
            _within(sent - t0, 2 * MB, owner.uplink)
            with anyio.fail_after(30):
                while not got:
                    await anyio.sleep(0.01)
            assert got[0][1].data == data
            _within(got[0][0] - sent, 2 * MB, node.downlink)
            tg.cancel_scope.cancel()
        assert owner.uplink.stats().bytes == 2 * MB
        assert node.downlink.stats().bytes == 2 * MB
    finally:
        await owner.aclose()
        await node.aclose()


# -- S3 errors -----------------------------------------------------------------------------------


def _client_error(status: int, code: str) -> BaseException:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def test_client_errors_are_classified() -> None:
    cases = {
        (503, "SlowDown"): (True, "throttled"),
        (429, "TooManyRequests"): (True, "throttled"),
        (500, "InternalError"): (True, "storage"),
        (502, "BadGateway"): (True, "storage"),
        (400, "RequestTimeout"): (True, "storage"),
        (403, "AccessDenied"): (False, "storage"),
        (404, "NoSuchBucket"): (False, "storage"),
        (400, "InvalidArgument"): (False, "storage"),
    }
    for (status, code), (retryable, check) in cases.items():
        err = convert_error(_client_error(status, code), "PUT k")
        assert (err.retryable, err.check) == (retryable, check), (status, code)
        assert code in err.message


class _Resetter:
    """A TCP server on 127.0.0.1 that accepts and resets every connection (SO_LINGER 0)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.accepted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.usefixtures("aws_environ")
async def test_reset_and_refused_connections_are_retryable() -> None:
    resetter = _Resetter()
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    closed_port = refused.getsockname()[1]
    refused.close()
    # aiohttp writes a request body from a task of its own; when the server resets the
    # connection first, that task fails too and nobody retrieves it.  The reset is this test's
    # doing: such stray errors are dropped, every other one still fails the test.
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), ConnectionResetError):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    try:
        for port in (resetter.port, closed_port):
            backend = S3Backend(S3Options(bucket="b-x", endpoint_url=f"http://127.0.0.1:{port}",
                                          addressing_style="path", connect_timeout_s=2,
                                          read_timeout_s=2))  # fmt: skip
            try:
                with pytest.raises(TransportError) as exc:
                    await backend.put("k", b"x")
                assert exc.value.retryable and exc.value.check == "connection", exc.value
            finally:
                await backend.aclose()
        assert resetter.accepted >= 1
    finally:
        resetter.close()
        gc.collect()  # a failed body-writer task reports when it is collected
        loop.set_exception_handler(previous)


async def test_a_missing_bucket_is_not_retried(moto_s3: S3Endpoint) -> None:
    transport = S3Transport(
        bucket="dcr-no-such-bucket", endpoint_url=moto_s3.url, addressing_style="path",
        backoff_s=0.01, backoff_max_s=0.01,
    )  # fmt: skip
    try:
        with pytest.raises(TransportError) as exc:
            await transport.send(PayloadKey(attempt=1, owner="o0", payload_id=0), b"x")
        assert not exc.value.retryable and "NoSuchBucket" in exc.value.message
        assert "after 1 tries" in exc.value.message
        assert transport.fetch_stats().retried == 0
    finally:
        await transport.aclose()
