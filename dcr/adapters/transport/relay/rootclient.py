"""A process's connection to the relay root (paper App. B "Transports", App. B.2): owners'
offers and data, the coordinator's stop and cleanup waves and status queries, each a request
the root answers.  The client watches the root's incarnation and silence, so a restarted or
vanished root fails every waiting request as retryable instead of leaving it waiting.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.security import Identity, Security
from dcr.adapters.transport.link import CHUNK as LINK_CHUNK
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.relay.config import RelayConfig
from dcr.adapters.transport.relay.frames import (
    HEADER_LIMIT,
    Answer,
    Cancel,
    Data,
    Delivered,
    Done,
    Frame,
    FrameError,
    Grant,
    Ping,
    Pong,
    Refused,
    encode,
)
from dcr.adapters.transport.relay.sockets import (
    CLIENT,
    connect,
    decode_frames,
    identify,
    set_common_options,
)
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Request", "RootClient"]


@dataclass(slots=True, eq=False)
class Request:
    """One call to the root waiting for its answer."""

    attempt: int | None
    key: PayloadKey | None = None
    data: bytes | None = None
    granted: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: TransportError | None = None
    answer: Answer | None = None
    paced: bool = False
    """Granted, its data waits for the sender's emulated link before it leaves."""
    sent: bool = False

    def fail(self, error: TransportError) -> None:
        if self.error is None and not self.done.is_set():
            self.error = error
        self.granted.set()
        self.done.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class RootClient:
    """A DEALER to the root: offers, data, stop and cleanup requests, queries.

    Every frame leaves through one writer in the order it was queued, so a process's sends
    reach the root in the order ``send`` was called.  The client pings the root every
    ``ping_interval_s``, also while idle, and learns the root's incarnation (its nonce) before
    its first request leaves, so a root that restarted is always noticed: silence for
    ``peer_timeout_s`` while a request waits, or a changed root incarnation, fails every
    waiting request as retryable (the attempt fails and is retried, paper App. B.2) instead of
    leaving it waiting for an answer that died with the old root.

    With keys (``security``) the DEALER is a CURVE client of ``identity`` (an owner or the
    coordinator) that talks only to the key of relay node ``server`` (the root's name).
    """

    def __init__(
        self,
        address: str,
        ctx: zmq.asyncio.Context,
        config: RelayConfig,
        on_data: Callable[[PayloadKey, int], None],
        uplink: LinkLimit | None = None,
        *,
        security: Security | None = None,
        identity: Identity | None = None,
        server: str | None = None,
    ) -> None:
        self.address = address
        self.config = config
        self.on_data = on_data
        self.uplink = uplink if uplink is not None and uplink.bytes_per_s is not None else None
        self.sock = ctx.socket(zmq.DEALER)
        try:
            set_common_options(self.sock, config)
            self.sock.setsockopt(zmq.MAXMSGSIZE, HEADER_LIMIT)  # the root sends headers only
            identify(
                self.sock, security or Security(), identity, CLIENT, secrets.token_hex(8), server
            )
        except BaseException:
            self.sock.close(linger=0)
            raise
        connect(self.sock, address)
        self.pending: dict[int, Request] = {}
        self.seq = itertools.count(1)
        self.outbox, self._outbox_recv = anyio.create_memory_object_stream[list[Any]](math.inf)
        self.heard = time.monotonic()
        self.root_nonce: int | None = None
        self.hello = anyio.Event()
        """Set once the root's incarnation is known (its first ``PONG``)."""
        self.broken: TransportError | None = None
        self.drops: Counter[str] = Counter()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read)
                tg.start_soon(self._write)
                tg.start_soon(self._keepalive)
        except* zmq.ZMQError as group:
            self.broken = TransportError(
                f"relay connection to {self.address} failed: {group.exceptions[0]}",
                retryable=True,
                check="socket",
            )
        finally:
            self.close()

    def close(self) -> None:
        """Fail whatever still waits (also when the reader task never ran)."""
        self.broken = self.broken or TransportError(
            "the relay transport was closed", retryable=False, check="closed"
        )
        self._fail_all(self.broken)
        self.outbox.close()
        self._outbox_recv.close()

    def _fail_all(self, error: TransportError) -> None:
        pending, self.pending = self.pending, {}
        for req in pending.values():
            req.fail(error)

    def _queue(self, parts: list[Any]) -> None:
        try:
            self.outbox.send_nowait(parts)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.drops["unsent"] += 1

    async def call(self, make: Callable[[int], Frame], req: Request) -> Request:
        """Queue the frame ``make(seq)`` and wait for the root's answer (and grant)."""
        if self.broken is not None:
            raise self.broken
        if not self.hello.is_set():
            await self._handshake(req)
        seq = next(self.seq)
        try:
            header = encode(make(seq))
        except FrameError as exc:
            raise TransportError(
                f"cannot encode a relay frame: {exc}",
                retryable=False,
                attempt=req.attempt,
                check="encode",
            ) from exc
        if not self.pending:
            self.heard = time.monotonic()
        self.pending[seq] = req
        try:
            self._queue([header])
            await req.granted.wait()
            req.check()
            if req.paced and self.uplink is not None:
                assert req.data is not None
                left = len(req.data)
                while left > 0 and req.error is None:  # a refusal ends the wait early
                    await self.uplink.take(min(left, LINK_CHUNK))
                    left -= LINK_CHUNK
                req.check()
                self._send_data(seq, req)
            await req.done.wait()
            req.check()
            return req
        finally:
            self.pending.pop(seq, None)
            if req.data is not None and not req.sent and req.error is None:
                self._queue([encode(Cancel(seq=seq))])  # the caller gave up before its data

    def _send_data(self, seq: int, req: Request) -> None:
        assert req.data is not None and req.key is not None
        self._queue([encode(Data(seq=seq, size=len(req.data))), req.data])
        req.sent = True
        self.on_data(req.key, len(req.data))

    async def _handshake(self, req: Request) -> None:
        """Wait for the root's incarnation (the keepalive pings until it answers)."""
        self._queue([encode(Ping(nonce=0))])
        with anyio.move_on_after(self.config.peer_timeout_s):
            await self.hello.wait()
        if self.broken is not None:
            raise self.broken
        if not self.hello.is_set():
            raise self._silent(req.attempt)

    def _silent(self, attempt: int | None = None) -> TransportError:
        return TransportError(
            f"the relay root {self.address} did not answer for {self.config.peer_timeout_s} s",
            retryable=True,
            attempt=attempt,
            check="peer-lost",
        )

    async def _write(self) -> None:
        async for parts in self._outbox_recv:
            await self.sock.send_multipart(parts, copy=False)

    async def _keepalive(self) -> None:
        ping = encode(Ping(nonce=0))
        while True:
            await anyio.sleep(self.config.ping_interval_s)
            self._queue([ping])  # also while idle: a restarted root is noticed before a call
            if self.pending and time.monotonic() - self.heard > self.config.peer_timeout_s:
                self._fail_all(self._silent())

    async def _read(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            self.heard = time.monotonic()
            try:
                frame, _ = decode_frames(parts, max_size=0)
            except FrameError as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            self._on_frame(frame)

    def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, Pong):
            if self.root_nonce is not None and frame.nonce != self.root_nonce:
                self._fail_all(
                    TransportError(
                        f"the relay root {self.address} restarted",
                        retryable=True,
                        check="root-restarted",
                    )
                )
            self.root_nonce = frame.nonce
            self.hello.set()
            return
        if not isinstance(frame, Grant | Delivered | Done | Answer | Refused):
            self.drops["direction"] += 1
            return
        req = self.pending.get(frame.seq)
        if isinstance(frame, Grant):
            if req is None or req.data is None or req.key is None:
                self._queue([encode(Cancel(seq=frame.seq))])
                return
            if self.uplink is None:
                self._send_data(frame.seq, req)
            else:
                req.paced = True  # call() sends it once the link carried it
            req.granted.set()
        elif req is None:
            self.drops["unknown"] += 1
        elif isinstance(frame, Refused):
            req.fail(
                TransportError(
                    frame.reason, retryable=frame.retryable, attempt=req.attempt, check=frame.check
                )
            )
        else:
            if isinstance(frame, Answer):
                req.answer = frame
            req.granted.set()
            req.done.set()
