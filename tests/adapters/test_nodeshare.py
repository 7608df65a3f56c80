"""Fetches shared by the processes of one rollout node: one download per object and node,
claims of dead processes taken over, waiters never stuck behind another process."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from dcr.adapters.transport.nodeshare import NodeFetches

pytestmark = pytest.mark.anyio

KEY = "dcr/attempt-00000000000000000001/payload/o0/w/0"


class Storage:
    """A stand-in for object storage that counts downloads and can be slow."""

    def __init__(self, data: bytes | None, delay_s: float = 0.0) -> None:
        self.data, self.delay_s, self.downloads = data, delay_s, 0

    async def get(self) -> bytes | None:
        self.downloads += 1
        await anyio.sleep(self.delay_s)
        return self.data


async def test_concurrent_fetches_download_once(tmp_path: Path) -> None:
    storage = Storage(b"payload-bytes" * 1000, delay_s=0.2)
    results: list[tuple[bytes | None, bool]] = []

    async def one() -> None:
        # A NodeFetches of its own per task, as each process of the node has.
        results.append(await NodeFetches(tmp_path).get(KEY, storage.get))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert storage.downloads == 1
    assert sorted(downloaded for _, downloaded in results) == [False, False, False, True]
    assert all(data == storage.data for data, _ in results)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")] == []


async def test_a_missing_object_is_not_shared(tmp_path: Path) -> None:
    storage = Storage(None)
    fetches = NodeFetches(tmp_path)
    assert await fetches.get(KEY, storage.get) == (None, True)
    assert await fetches.get(KEY, storage.get) == (None, True)
    assert storage.downloads == 2 and list(tmp_path.iterdir()) == []


async def test_the_claim_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fetches = NodeFetches(tmp_path, wait_s=60)
    claim = fetches._path(KEY).with_name(fetches._path(KEY).name + ".lock")
    claim.write_text(f"{dead.pid}\n")
    storage = Storage(b"x" * 10)
    with anyio.fail_after(30):
        assert await fetches.get(KEY, storage.get) == (b"x" * 10, True)
    assert storage.downloads == 1 and not claim.exists()


async def test_a_waiter_downloads_itself_when_the_holder_takes_too_long(tmp_path: Path) -> None:
    fetches = NodeFetches(tmp_path, wait_s=0.3)
    claim = fetches._path(KEY).with_name(fetches._path(KEY).name + ".lock")
    claim.write_text(f"{os.getpid()}\n")  # a live holder that never publishes
    storage = Storage(b"y")
    t0 = time.monotonic()
    assert await fetches.get(KEY, storage.get) == (b"y", True)
    assert time.monotonic() - t0 >= 0.3
    assert claim.exists()  # not ours to remove


async def test_a_discarded_copy_is_downloaded_again(tmp_path: Path) -> None:
    storage = Storage(b"z" * 5)
    fetches = NodeFetches(tmp_path)
    assert await fetches.get(KEY, storage.get) == (b"z" * 5, True)
    assert await fetches.get(KEY, storage.get) == (b"z" * 5, False)
    fetches.discard(KEY)
    assert await fetches.get(KEY, storage.get) == (b"z" * 5, True)
    assert storage.downloads == 2


async def test_old_copies_are_swept(tmp_path: Path) -> None:
    fetches = NodeFetches(tmp_path, keep_s=1.0)
    old = tmp_path / ("0" * 64)
    old.write_bytes(b"old")
    os.utime(old, (time.time() - 10, time.time() - 10))
    await fetches.get(KEY, Storage(b"new").get)
    assert not old.exists() and fetches._path(KEY).exists()


def _process(directory: str, key: str, out: str) -> None:
    async def main() -> None:
        async def download() -> bytes:
            Path(out, f"download-{os.getpid()}").touch()
            await anyio.sleep(0.3)
            return b"shared" * 100_000

        data, _ = await NodeFetches(directory).get(key, download)
        Path(out, f"got-{os.getpid()}").write_bytes(data or b"")

    anyio.run(main)


def test_processes_of_a_node_download_an_object_once(tmp_path: Path) -> None:
    shared, out = tmp_path / "node", tmp_path / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(str(shared), KEY, str(out))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(list(out.glob("download-*"))) == 1
    got = sorted(out.glob("got-*"))
    assert len(got) == 3 and all(g.read_bytes() == b"shared" * 100_000 for g in got)
