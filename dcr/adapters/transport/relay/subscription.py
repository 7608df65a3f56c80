"""A receiver's subscription at its relay node (paper App. C, queueing ACKs): the receiver's
DEALER to the node, its heartbeat, the inbox its deliveries wait in until read, the window of
deliveries not taken yet, and the stop waves it confirms.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter, deque
from typing import cast

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.security import Identity, Security
from dcr.adapters.transport.base import Delivery
from dcr.adapters.transport.relay.config import Held, RelayConfig
from dcr.adapters.transport.relay.frames import (
    Ack,
    Done,
    Frame,
    FrameError,
    Payload,
    Ping,
    Stop,
    Subscribe,
    encode,
)
from dcr.adapters.transport.relay.sockets import (
    RECEIVER,
    connect,
    decode_frames,
    identify,
    send_now,
    set_common_options,
)
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey

__all__ = ["Subscription"]


class Subscription:
    """One receiver's DEALER to its relay node: with keys (``security``) a CURVE client of
    ``receiver:<name>`` that talks only to the key of relay node ``server``; without, its
    routing id carries the receiver's name.  ``SUBSCRIBE`` names the receiver too.

    It repeats ``SUBSCRIBE`` every ``ping_interval_s`` as its heartbeat, so after its node
    restarts at the same address (ZeroMQ reconnects by itself) the receiver is subscribed
    again within one interval.  Deliveries wait in an inbox until read; the node never sends
    more than the advertised window of deliveries that were not taken yet.
    """

    def __init__(
        self,
        receiver: str,
        address: str,
        ctx: zmq.asyncio.Context,
        config: RelayConfig,
        *,
        security: Security | None = None,
        server: str | None = None,
    ) -> None:
        self.receiver = receiver
        self.config = config
        security = security or Security()
        identity = Identity("receiver", receiver) if security.keyed else None
        self.sock = ctx.socket(zmq.DEALER)
        try:
            set_common_options(self.sock, config)
            identify(self.sock, security, identity, RECEIVER, receiver, server)
        except BaseException:
            self.sock.close(linger=0)
            raise
        connect(self.sock, address)
        self.nonce = secrets.randbits(63) | 1
        self.inbox: deque[Delivery] = deque()
        self.untaken: dict[PayloadKey, deque[tuple[int, int]]] = {}
        self.count = self.bytes = self.peak_count = self.peak_bytes = self.largest = 0
        self.closed = False
        self.wake: anyio.Event | None = None
        self.last_payload = (0, 0)
        self.last_wave = (0, 0)
        self.drops: Counter[str] = Counter()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._beat)
                tg.start_soon(self._read)
        except* (zmq.ZMQError, TransportError):
            self.drops["socket"] += 1
        finally:
            self.close()

    def close(self) -> None:
        """End the deliveries: nothing more is yielded, even what already arrived."""
        self.closed = True
        self.inbox.clear()
        self._wake()

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def emit(self, frame: Frame) -> None:
        if self.sock.closed or not send_now(self.sock, [encode(frame)]):
            self.drops["unsent"] += 1

    async def _beat(self) -> None:
        frame = Subscribe(
            nonce=self.nonce,
            window=self.config.receiver_window,
            window_bytes=self.config.receiver_window * self.config.max_payload_bytes,
            receiver=self.receiver,
        )
        while True:
            self.emit(frame)
            await anyio.sleep(self.config.ping_interval_s)

    async def _read(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                frame, body = decode_frames(parts, max_size=self.config.max_payload_bytes)
            except FrameError as exc:
                self.drops[exc.check or "malformed"] += 1
                continue
            if isinstance(frame, Payload):
                assert body is not None
                self._on_payload(frame, cast(zmq.Frame, body).bytes)
            elif isinstance(frame, Stop):
                self._on_stop(frame)
            elif not isinstance(frame, Ping):
                self.drops["direction"] += 1

    def _on_payload(self, frame: Payload, data: bytes) -> None:
        if frame.origin == self.last_payload[0] and frame.seq <= self.last_payload[1]:
            self.drops["replayed"] += 1
            return
        self.last_payload = (frame.origin, frame.seq)
        self.inbox.append(Delivery(key=frame.key, data=data, addressed=frame.to is not None))
        self.untaken.setdefault(frame.key, deque()).append((frame.seq, frame.size))
        self.count += 1
        self.bytes += frame.size
        self.peak_count = max(self.peak_count, self.count)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.largest = max(self.largest, frame.size)
        self._wake()

    def _on_stop(self, frame: Stop) -> None:
        """Drop what this receiver holds of the attempt, then confirm to the node."""
        if frame.origin == self.last_wave[0] and frame.seq <= self.last_wave[1]:
            self.drops["replayed"] += 1
            return
        self.last_wave = (frame.origin, frame.seq)
        self.inbox = deque(d for d in self.inbox if d.key.attempt != frame.attempt)
        for key in [k for k in self.untaken if k.attempt == frame.attempt]:
            for _, size in self.untaken.pop(key):
                self.count -= 1
                self.bytes -= size
        self.emit(Done(seq=frame.seq))

    def take(self, key: PayloadKey) -> None:
        entries = self.untaken.get(key)
        if not entries:
            self.drops["unknown"] += 1
            return
        seq, size = entries.popleft()
        if not entries:
            del self.untaken[key]
        self.count -= 1
        self.bytes -= size
        self.emit(Ack(seq=seq))

    def held(self) -> Held:
        return Held(
            count=self.count,
            bytes=self.bytes,
            peak_count=self.peak_count,
            peak_bytes=self.peak_bytes,
            max_count=self.config.receiver_window,
            max_bytes=self.config.receiver_window * max(self.largest, 1),
        )
