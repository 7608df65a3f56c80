"""The owner side of the object-storage transport: uploads, manifest entries in posting order,
tombstones and the sweeps of ``cleanup`` (paper App. C: ``put`` + ``post_manifest``).

**Stopping across processes** (App. B.2, stopping an attempt).  ``stop_and_wait`` and
``cleanup`` write the attempt's tombstone, then wait for this process's sends of it.  A sender
reads the tombstone before it uploads, before it posts the manifest entry and after; when it
finds one it deletes what it wrote and refuses the send (``retryable=False``, check
``stopped``).  On storage with read-after-write consistency (S3, a local or NFS directory)
every object of a stopped attempt is therefore either seen by ``cleanup``'s listing or deleted
by its sender.  Nodes never fetch an attempt that has a tombstone.  ``cleanup`` deletes the
attempt's objects and aborts its incomplete uploads; the tombstone stays ``tombstone_ttl_s``
to refuse late senders (a process that died between its upload and its check leaves an
object behind), then a later ``cleanup`` sweeps that attempt again and drops the tombstone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import anyio
import msgspec

from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore.config import ObjectStoreConfig
from dcr.adapters.transport.objstore.layout import (
    ENTRY_FORMAT,
    MANIFEST,
    MANIFEST_RE,
    PAYLOADS,
    ManifestEntry,
    attempt_segment,
    encode_entry,
    manifest_key,
    payload_key,
    tombstone_key,
)
from dcr.adapters.transport.objstore.storage import Storage
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["KEEP_ATTEMPTS", "Sender", "stopped_error"]

KEEP_ATTEMPTS = 64


class _Turns:
    """The order in which one writer posts the manifest entries of one (attempt, owner)."""

    def __init__(self) -> None:
        self.next = 0
        self._posted = 0
        self._done: set[int] = set()
        self._moved = anyio.Event()

    def take(self) -> int:
        seq = self.next
        self.next += 1
        return seq

    async def wait(self, seq: int) -> None:
        while self._posted < seq:
            await self._moved.wait()

    def finish(self, seq: int) -> None:
        self._done.add(seq)
        while self._posted in self._done:
            self._done.discard(self._posted)
            self._posted += 1
        self._moved.set()
        self._moved = anyio.Event()


class Sender:
    """The sending side of one transport object (writer ``writer``): its sends, the attempts
    it knows stopped, and its stops and cleanups."""

    def __init__(self, storage: Storage, writer: str, uplink: LinkLimit) -> None:
        self.storage = storage
        self.writer = writer
        self.uplink = uplink
        self.stopped: set[int] = set()
        """Attempts stopped here, or found stopped by their tombstone."""
        self.turns: dict[tuple[int, str], _Turns] = {}
        self.inflight: dict[int, int] = {}
        self._idle = anyio.Event()
        self.sent_keys: set[PayloadKey] = set()
        self.sent = TransportStats()

    @property
    def config(self) -> ObjectStoreConfig:
        return self.storage.config

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> bool:
        """Upload the payload, then post its manifest entry; returns once both are stored
        (``True``), or at once for a payload addressed to nobody (``False``)."""
        attempt = key.attempt
        if attempt in self.stopped:
            raise stopped_error(attempt)
        if len(data) > self.config.max_payload_bytes:
            raise TransportError(
                f"payload of {len(data)} bytes above max_payload_bytes "
                f"{self.config.max_payload_bytes}",
                retryable=False,
                attempt=attempt,
                check="oversized",
            )
        if to is not None and not to:
            return False  # addressed to nobody
        if (attempt, key.owner) not in self.turns:
            self._forget_old_sends()
        turns = self.turns.setdefault((attempt, key.owner), _Turns())
        seq = turns.take()
        obj = payload_key(attempt, key.owner, self.writer, seq)
        entry = manifest_key(attempt, key.owner, self.writer, seq)
        body = encode_entry(
            ManifestEntry(
                format=ENTRY_FORMAT,
                attempt=attempt,
                owner=key.owner,
                payload_id=key.payload_id,
                size=len(data),
                to=None if to is None else sorted(to),
            ),
            entry,
            self.config.manifest_seal_key,
        )
        what = f"{key.owner}/{key.payload_id}"
        storage = self.storage
        self.inflight[attempt] = self.inflight.get(attempt, 0) + 1
        written: list[str] = []
        try:
            await self._guard(attempt)
            written.append(obj)
            await storage.retry(f"upload of {what}",
                                lambda: storage.backend.put(obj, data, link=self.uplink),
                                attempt=attempt)  # fmt: skip
            await turns.wait(seq)
            await self._guard(attempt)
            written.append(entry)
            await storage.retry(f"manifest entry of {what}",
                                lambda: storage.backend.put(entry, body),
                                attempt=attempt)  # fmt: skip
            await self._guard(attempt)
        except BaseException:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(10),
                contextlib.suppress(TransportError),
            ):
                await storage.backend.delete(written)
            raise
        finally:
            turns.finish(seq)
            self.inflight[attempt] -= 1
            if not self.inflight[attempt]:
                del self.inflight[attempt]
                self._idle.set()
                self._idle = anyio.Event()
        s = self.sent
        new = key not in self.sent_keys
        self.sent_keys.add(key)
        self.sent = TransportStats(
            payloads=s.payloads + new,
            payload_bytes=s.payload_bytes + (len(data) if new else 0),
            cross_bytes=s.cross_bytes + len(data),
        )
        return True

    def _forget_old_sends(self) -> None:
        """Bound what an owner process remembers: the posting order and V_payload keys of
        the most recent ``KEEP_ATTEMPTS`` attempts it sent for (an owner never cleans up;
        the coordinator does, in its own process)."""
        attempts = sorted({a for a, _ in self.turns} - set(self.inflight))
        if len(attempts) < KEEP_ATTEMPTS:
            return
        old = set(attempts[: len(attempts) - KEEP_ATTEMPTS + 1])
        self.turns = {k: t for k, t in self.turns.items() if k[0] not in old}
        self.sent_keys = {k for k in self.sent_keys if k.attempt not in old}

    async def _guard(self, attempt: int) -> None:
        """Refuse the send when the attempt was stopped here or anywhere (its tombstone)."""
        if attempt in self.stopped:
            raise stopped_error(attempt)
        found = await self.storage.retry("reading the tombstone",
                                         lambda: self.storage.backend.get(tombstone_key(attempt)),
                                         attempt=attempt)  # fmt: skip
        if found is not None:
            self.stopped.add(attempt)
            raise stopped_error(attempt)

    async def stop_and_wait(self, attempt: int) -> None:
        """Write the tombstone of ``attempt`` (already stopped here), then wait for this
        process's sends of it."""
        with self._finishing("writing the tombstone", attempt):
            await self._tombstone(attempt)
        await self._drained(attempt)

    async def cleanup(self, attempt: int) -> None:
        """Write the tombstone of ``attempt`` (already stopped here), wait for this process's
        sends of it, delete its objects and abort its incomplete uploads, forget it; then
        sweep attempts whose tombstones outlived ``tombstone_ttl_s``."""
        with self._finishing("cleanup", attempt):
            await self._tombstone(attempt)
            await self._drained(attempt)
            await self._sweep(attempt)
            for k in [k for k in self.turns if k[0] == attempt]:
                del self.turns[k]
            self.sent_keys = {k for k in self.sent_keys if k.attempt != attempt}
            await self._collect_tombstones()

    @contextlib.contextmanager
    def _finishing(self, what: str, attempt: int) -> Iterator[None]:
        """Shielded from cancellation, bounded by ``cleanup_timeout_s``."""
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + self.config.cleanup_timeout_s
            yield
        if scope.cancelled_caught:
            raise TransportError(
                f"{what} on {self.storage.backend.describe()} took over "
                f"{self.config.cleanup_timeout_s} s",
                retryable=True,
                attempt=attempt,
                check="timeout",
            )

    async def _tombstone(self, attempt: int) -> None:
        body = msgspec.json.encode({"attempt": attempt, "writer": self.writer, "t": time.time()})
        await self.storage.retry("writing the tombstone",
                                 lambda: self.storage.backend.put(tombstone_key(attempt), body),
                                 attempt=attempt)  # fmt: skip

    async def _drained(self, attempt: int) -> None:
        while self.inflight.get(attempt):
            await self._idle.wait()

    async def _sweep(self, attempt: int, *, tombstone: bool = False) -> None:
        """Delete the attempt's payloads and manifest entries (and its tombstone)."""
        storage = self.storage
        a = attempt_segment(attempt)
        keep = None if tombstone else tombstone_key(attempt)
        found: list[str] = []
        for prefix in (f"{PAYLOADS}{a}/", f"{MANIFEST}{a}/"):
            listed = await storage.list(prefix, attempt)
            found += [o.key for o in listed if o.key != keep]
        if found:
            await storage.retry("deleting the attempt's objects",
                                lambda: storage.backend.delete(found), attempt=attempt)  # fmt: skip
        await storage.retry("aborting the attempt's uploads",
                            lambda: storage.backend.abort_uploads(f"{PAYLOADS}{a}/"),
                            attempt=attempt)  # fmt: skip

    async def _collect_tombstones(self) -> None:
        horizon = time.time() - self.config.tombstone_ttl_s
        for info in await self.storage.list(MANIFEST):
            m = MANIFEST_RE.match(info.key)
            if m is not None and m[2] is None and info.modified < horizon:
                await self._sweep(int(m[1]), tombstone=True)

    async def purge(self) -> None:
        """Delete every payload, manifest entry and tombstone under the store's root and
        abort incomplete uploads."""
        storage = self.storage
        found = [o.key for p in (PAYLOADS, MANIFEST) for o in await storage.list(p)]
        if found:
            await storage.retry("purging the store", lambda: storage.backend.delete(found))
        await storage.retry("aborting uploads", lambda: storage.backend.abort_uploads(PAYLOADS))


def stopped_error(attempt: int) -> TransportError:
    """The refusal of a send of a stopped attempt."""
    return TransportError(
        "the attempt was stopped; payload refused",
        retryable=False,
        attempt=attempt,
        check="stopped",
    )
