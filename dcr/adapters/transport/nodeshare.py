"""Payload fetches shared by the processes of one rollout node (object storage).

Object storage is read per process: every receiver process of a node would download every
payload across the boundary, so a node whose engine runs TP=8 worker processes would pull each
payload eight times (V_cross = processes x V_payload).  The paper's rollout node downloads it
once.  :class:`NodeFetches` restores that through a directory the processes of the node share
(local disk or tmpfs):

* the first process to want an object *claims* it -- ``<digest>.lock`` created exclusively,
  holding its pid -- downloads it and publishes it by an atomic rename to ``<digest>``;
* the others wait for the published file and read it (no cross-boundary traffic);
* a claim whose process is gone (a receiver SIGKILLed mid-download) is taken over, and a
  waiter that waited ``wait_s`` downloads the object itself, so no process ever depends on
  another one finishing;
* a copy whose length differs from the manifest entry is discarded by the transport, so the
  next try downloads it again; copies of payloads whose manifest entries were cleaned up
  (after a commit or a stop) are discarded by every process that notices, and copies older
  than ``keep_s`` are swept (a node whose processes all stopped leaves at most those).

Objects are immutable under their keys (every key names an attempt, an owner and a writer),
and receivers check every payload's digest, so a shared copy never needs invalidating.

No file of the directory is opened through a symbolic link: a copy is written to a new
temporary file of an unpredictable name (created exclusively, ``O_NOFOLLOW``) before its
rename, and a link found where a copy belongs is removed and the object fetched again.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.to_thread

__all__ = ["NodeFetches"]

_STALE_CLAIM_S = 10.0
"""A claim file without a readable pid after this long is taken over (its process died
between creating and writing it)."""
_SWEEP_LIMIT = 10_000
"""Entries one sweep looks at (bounds its cost in a large directory)."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""A new file, never an existing one nor the target of a link planted at its name."""


class NodeFetches:
    """Downloads of one node's processes, shared through ``directory`` (created if needed)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        wait_s: float = 300.0,
        poll_s: float = 0.005,
        keep_s: float = 3600.0,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._last_sweep = 0.0

    def _path(self, key: str) -> Path:
        return self.directory / hashlib.sha256(key.encode()).hexdigest()

    async def get(
        self, key: str, fetch: Callable[[], Awaitable[bytes | None]]
    ) -> tuple[bytes | None, bool]:
        """The object under ``key`` and whether this process downloaded it (``fetch``).

        A copy another process of the node published is read from the directory; otherwise
        this process downloads it under a claim and publishes it.  ``None`` (no such object)
        is not shared: each process asks storage itself.
        """
        path = self._path(key)
        claim = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + self.wait_s
        while True:
            data = await anyio.to_thread.run_sync(_read, path)
            if data is not None:
                return data, False
            if _claim(claim):
                try:
                    # Published between our look and our claim (its claim just released)?
                    data = await anyio.to_thread.run_sync(_read, path)
                    if data is not None:
                        return data, False
                    data = await fetch()
                    if data is not None:
                        await anyio.to_thread.run_sync(self._publish, path, data)
                    return data, True
                finally:
                    claim.unlink(missing_ok=True)
            if _abandoned(claim):
                claim.unlink(missing_ok=True)
                continue
            if time.monotonic() > deadline:
                return await fetch(), True
            await anyio.sleep(self.poll_s)

    def discard(self, key: str) -> None:
        """Forget the shared copy of ``key`` (it did not match its manifest entry)."""
        self._path(key).unlink(missing_ok=True)

    def _publish(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(16)}.tmp")
        fd = os.open(tmp, _CREATE, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        now = time.time()
        if now - self._last_sweep > min(self.keep_s, 60.0):
            self._last_sweep = now
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Remove published copies and leftovers older than ``keep_s``."""
        with os.scandir(self.directory) as entries:
            for i, entry in enumerate(entries):
                if i >= _SWEEP_LIMIT:
                    return
                if entry.name.endswith(".lock"):
                    continue
                try:
                    if now - entry.stat().st_mtime > self.keep_s:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass


def _read(path: Path) -> bytes | None:
    """The published copy at ``path``; ``None`` when there is none, or when a link stands
    there (removed, never followed: the object is then fetched and published again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        path.unlink(missing_ok=True)
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _claim(claim: Path) -> bool:
    try:
        fd = os.open(claim, _CREATE, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True


def _abandoned(claim: Path) -> bool:
    """Whether the process holding ``claim`` is gone (or never wrote its pid)."""
    try:
        text = claim.read_text()
        age = time.time() - claim.stat().st_mtime
    except FileNotFoundError:
        return False  # released meanwhile: the next look finds the copy or claims it
    try:
        pid = int(text)
    except ValueError:
        return age > _STALE_CLAIM_S
    try:
        os.kill(pid, 0)  # signal 0: existence only, nothing is sent
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited but was not reaped yet (Linux; elsewhere False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
