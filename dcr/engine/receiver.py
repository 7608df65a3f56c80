"""The receiver engine: runs :class:`~dcr.protocol.receiver.ReceiverCore` on anyio.

Payloads arrive from the transport; the engine runs the reception checks on their bytes
(key against header, digest, schema, names, shapes, dtypes, loader classification -- a full
strict decode) and reports ``PayloadArrived``; the core decides whether to stage, decode,
apply or discard.  Decoding and applying through the native loader run in worker threads.  When
the core's bounded queue is full it pauses ingestion: arrivals wait, unread, except the one
payload the declared order needs next.  Request-gate and KV-cache actions go to
:class:`ReceiverHooks`, which an inference engine implements.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import torch
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from dcr.adapters.control.base import ControlChannel
from dcr.adapters.transport.base import Delivery, Transport
from dcr.apply.receiver import Receiver
from dcr.engine.setup import Integration, default_limiter
from dcr.errors import DcrError, PayloadRejected
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import CommitRecord, Mode, PayloadKey
from dcr.wire.payload import Payload, decode_payload

__all__ = ["ReceiverHooks", "ReceiverService", "open_receiver"]

Hook = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverHooks:
    """What the serving runtime does at the request gate (paper §7.2).

    ``close_gate`` admits no new generation requests and returns once in-flight ones finished;
    ``invalidate_kv_cache`` drops KV-cache entries computed with the old weights;
    ``open_gate`` admits requests again.  The defaults do nothing (no requests are served).
    """

    close_gate: Hook = _nothing
    invalidate_kv_cache: Hook = _nothing
    open_gate: Hook = _nothing


@dataclass(slots=True)
class ReceiverService:
    """One receiver endpoint: the protocol core, ingestion, decode and in-place apply."""

    name: str
    receiver: Receiver
    integration: Integration
    control: ControlChannel
    transport: Transport
    held: CommitRecord | None
    """The committed record the storage holds, or ``None`` for a receiver that must first
    restore one by dense refit."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    hooks: ReceiverHooks = field(default_factory=ReceiverHooks)
    limiter: anyio.CapacityLimiter = field(default_factory=default_limiter)
    on_applied: Callable[[PayloadKey], None] | None = None
    """Called after each payload applied in place (fault injection, progress)."""
    core: ReceiverCore = field(init=False)
    gate_open: bool = field(init=False)
    applied_payloads: int = 0
    decode_seconds: float = 0.0
    apply_seconds: float = 0.0
    _owner_names: dict[int, str] = field(default_factory=dict)
    _bytes: dict[PayloadKey, bytes] = field(default_factory=dict)
    _decoded: dict[PayloadKey, Payload] = field(default_factory=dict)
    _parked: OrderedDict[PayloadKey, Delivery] = field(default_factory=OrderedDict)
    _paused: bool = False
    _want: PayloadKey | None = None
    _events: MemoryObjectSendStream[object] | None = None
    _sync: dict[int, bool] = field(default_factory=dict)
    _arrived: set[PayloadKey] = field(default_factory=set)
    _accepted: set[PayloadKey] = field(default_factory=set)
    """Keys whose first copy passed the reception checks (its bytes are the ones kept)."""

    def __post_init__(self) -> None:
        self.core = ReceiverCore(self.name, held=self.held, queue=self.queue)
        self.gate_open = self.held is not None
        self._owner_names = {i: n for n, i in self.integration.owner_ids.items()}

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve control calls and payloads until cancelled."""
        inbox = self.control.endpoint_inbox(self.name)
        deliveries = self.transport.subscribe(self.name)
        send, recv = anyio.create_memory_object_stream[object](math.inf)
        self._events = send
        try:
            with send, recv:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._forward, inbox)
                    tg.start_soon(self._ingest, deliveries)
                    task_status.started()
                    async for message in recv:
                        await self._handle(message, tg)
        finally:
            self.control.close_endpoint(self.name)
            self.transport.unsubscribe(self.name)

    async def dense_refit(
        self, state_dict: Mapping[str, torch.Tensor], record: CommitRecord
    ) -> None:
        """Restore ``record`` by a dense load through the native loader, then report ready."""
        await anyio.to_thread.run_sync(self.receiver.dense_load, state_dict, limiter=self.limiter)
        await self._local(ev.DenseRefitDone(record=record))

    # -- plumbing ---------------------------------------------------------------------------

    async def _forward(self, inbox: AsyncIterator[object]) -> None:
        async for message in inbox:
            await self._local(message)

    async def _local(self, event: object) -> None:
        assert self._events is not None
        await self._events.send(event)

    async def _ingest(self, deliveries: AsyncIterator[Delivery]) -> None:
        """Move arrivals into the event stream unless the queue back-pressures ingestion."""
        async for d in deliveries:
            self._arrived.add(d.key)
            if self._paused and d.key != self._want:
                self._parked[d.key] = d
            else:
                await self._local(d)

    async def _release_parked(self) -> None:
        if not self._paused:
            while self._parked:
                await self._local(self._parked.popitem(last=False)[1])
        elif self._want is not None and self._want in self._parked:
            await self._local(self._parked.pop(self._want))

    async def _handle(self, message: object, tg: TaskGroup) -> None:
        if isinstance(message, Delivery):
            event: object = await self._check(message)
        elif isinstance(message, ev.PrepareRequested):
            event = ev.PrepareRequested(info=message.info, rejection=self._prepare_check(message))
            self._sync[message.info.attempt] = message.info.sync
        else:
            event = message
            if isinstance(message, ev.FlushRequested):
                tg.start_soon(self._arrival_check, message.attempt, message.expected)
        for c in self.core.handle(event):  # type: ignore[arg-type]
            await self._execute(c, tg)

    def _prepare_check(self, message: ev.PrepareRequested) -> str | None:
        """The engine's metadata and loader-classification check at prepare (a *reject*)."""
        if not self.receiver.paths:
            return "prewarm"
        if message.info.mode is Mode.MIXED and not self.integration.xor_names <= (
            self.receiver.xor_allowed()
        ):
            return "classification"
        try:
            self.receiver.loader.check_ready()
        except DcrError:
            return "classification"
        return None

    async def _check(self, d: Delivery) -> ev.PayloadArrived:
        """Reception checks on the bytes (paper App. B.1) -> ``PayloadArrived``."""
        key = d.key
        digest = hashlib.blake2b(d.data, digest_size=16).digest()
        rejection: str | None = None
        final = False
        payload: Payload | None = None
        try:
            payload = await anyio.to_thread.run_sync(self._decode, d.data, limiter=self.limiter)
            h = payload.header
            final = h.final
            if (h.attempt, self._owner_names.get(h.owner), h.payload_id) != (
                key.attempt,
                key.owner,
                key.payload_id,
            ):
                rejection = "schema"
        except PayloadRejected as exc:
            rejection = exc.check or "schema"
        if rejection is None and payload is not None and key not in self._accepted:
            # Only a key's first good copy is kept; the core deduplicates the others.
            self._accepted.add(key)
            self._bytes[key] = d.data
            if self._sync.get(key.attempt, True):
                self._decoded[key] = payload
        return ev.PayloadArrived(
            attempt=key.attempt,
            owner=key.owner,
            payload_id=key.payload_id,
            digest=digest,
            final=final,
            rejection=rejection,
        )

    async def _arrival_check(self, attempt: int, expected: tuple[tuple[str, int], ...]) -> None:
        """Fail the attempt for payloads still missing once the transport's grace has passed."""
        await anyio.sleep(self.transport.arrival_grace_s)
        info = self.core.attempt
        if info is None or info.attempt != attempt:
            return
        for owner, count in expected:
            for pid in range(count):
                key = PayloadKey(attempt=attempt, owner=owner, payload_id=pid)
                if key not in self._arrived:
                    await self._local(
                        ev.PayloadArrived(
                            attempt=attempt,
                            owner=owner,
                            payload_id=pid,
                            digest=b"",
                            final=False,
                            rejection="missing",
                        )
                    )
                    return

    def _decode(self, data: bytes) -> Payload:
        t0 = time.perf_counter()
        try:
            return decode_payload(
                data,
                catalog=self.integration.catalog,
                limits=self.integration.limits,
                xor_allowed=self.receiver.xor_allowed(),
            )
        finally:
            self.decode_seconds += time.perf_counter() - t0

    # -- commands ---------------------------------------------------------------------------

    async def _execute(self, c: cmd.ReceiverCommand, tg: TaskGroup) -> None:
        match c:
            case cmd.Notify(event=event):
                await self.control.notify(event)
            case cmd.Discard(key=key, reason=reason):
                if reason != "duplicate":  # a duplicate's bytes were never kept
                    self._bytes.pop(key, None)
                    self._decoded.pop(key, None)
            case cmd.StagePayload(key=key):
                if not self._sync.get(key.attempt, True):
                    self._decoded.pop(key, None)  # asynchronous RL keeps compressed bytes only
            case cmd.Decode(key=key):
                tg.start_soon(self._decode_staged, key)
            case cmd.Apply(attempt=tau, keys=keys):
                tg.start_soon(self._apply, tau, keys)
            case cmd.PauseIngest(want=want):
                self._paused, self._want = True, want
                await self._release_parked()
            case cmd.ResumeIngest():
                self._paused, self._want = False, None
                await self._release_parked()
            case cmd.CloseGate(attempt=tau):
                tg.start_soon(self._close_gate, tau)
            case cmd.Synchronize(attempt=tau):
                tg.start_soon(self._synchronize, tau)
            case cmd.InvalidateKvCache():
                await self.hooks.invalidate_kv_cache()
            case cmd.OpenGate():
                await self.hooks.open_gate()
                self.gate_open = True
            case cmd.Release(attempt=tau):
                for store in (self._bytes, self._decoded):
                    for key in [k for k in store if k.attempt == tau]:
                        del store[key]
                self._arrived = {k for k in self._arrived if k.attempt != tau}
                self._accepted = {k for k in self._accepted if k.attempt != tau}

    async def _decode_staged(self, key: PayloadKey) -> None:
        failure = None
        if key not in self._decoded:
            data = self._bytes.get(key)
            if data is None:
                failure = "released"
            else:
                try:
                    self._decoded[key] = await anyio.to_thread.run_sync(
                        self._decode, data, limiter=self.limiter
                    )
                except PayloadRejected as exc:
                    failure = exc.check or "schema"
        await self._local(ev.PayloadDecoded(key=key, failure=failure))

    def _apply_group(self, attempt: int, keys: tuple[PayloadKey, ...]) -> None:
        for key in keys:
            payload = self._decoded.pop(key)
            t0 = time.perf_counter()
            try:
                self.receiver.apply_items(payload.items, attempt=attempt)
            finally:
                self.apply_seconds += time.perf_counter() - t0
            self._bytes.pop(key, None)
            self.applied_payloads += 1
            if self.on_applied is not None:
                self.on_applied(key)

    async def _apply(self, attempt: int, keys: tuple[PayloadKey, ...]) -> None:
        failure = None
        try:
            await anyio.to_thread.run_sync(self._apply_group, attempt, keys, limiter=self.limiter)
        except DcrError as exc:
            failure = exc.check or "apply"
        except KeyError:
            failure = "released"
        await self._local(
            ev.PayloadsApplied(
                attempt=attempt,
                keys=keys,
                failure=failure,
                post_apply_checked=self.receiver.config.post_apply_checks,
            )
        )

    async def _close_gate(self, attempt: int) -> None:
        self.gate_open = False
        await self.hooks.close_gate()
        await self._local(ev.RequestsDrained(attempt=attempt))

    async def _synchronize(self, attempt: int) -> None:
        device = self.receiver.device
        if device.type == "cuda":
            await anyio.to_thread.run_sync(torch.cuda.synchronize, device, limiter=self.limiter)
        await self._local(ev.Synchronized(attempt=attempt))


@asynccontextmanager
async def open_receiver(service: ReceiverService) -> AsyncIterator[ReceiverService]:
    """Serve ``service`` for the duration of the block (in a task group of its own)."""
    async with anyio.create_task_group() as tg:
        await tg.start(service.serve)
        try:
            yield service
        finally:
            tg.cancel_scope.cancel()
