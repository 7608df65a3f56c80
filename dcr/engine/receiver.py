"""The receiver engine: runs :class:`~dcr.protocol.receiver.ReceiverCore` on anyio.

The engine executes; the core decides.  Each payload the transport hands over is numbered
and reported to the core, which asks for its reception checks (key against header, digest --
with a fleet secret, the keyed seal --, schema, names, shapes, dtypes, loader classification:
a full strict decode) or keeps it parked while its bounded queue back-pressures ingestion.
Decoding and applying through the native loader run in worker threads.  Request-gate and
KV-cache actions go to :class:`ReceiverHooks`, which an inference engine implements.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from dcr.adapters.control.base import ControlChannel, EndpointLink
from dcr.adapters.transport.base import Delivery, Transport
from dcr.apply.applier import Applier
from dcr.apply.proof import receiver_proof
from dcr.engine.integration import Integration, default_limiter, serving
from dcr.errors import DcrError, PayloadRejected
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import CommitRecord, Mode, PayloadKey
from dcr.wire.format import DIGEST_OFFSET, HEADER_SIZE
from dcr.wire.payload import Payload, decode_payload
from dcr.wire.seal import payload_key

__all__ = ["ReceiverHooks", "ReceiverService", "open_receiver"]

Hook = Callable[[], Awaitable[None]]

_CATALOG_CHECKS = frozenset({"name", "shape", "dtype"})
"""Reception checks of an item against the receiver's catalog."""


async def _nothing() -> None:
    return None


async def _nothing_held(record: CommitRecord) -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiverHooks:
    """What the serving runtime does at the request gate (paper §7.2).

    ``close_gate`` admits no new generation requests and returns once in-flight ones finished;
    ``invalidate_kv_cache`` drops KV-cache entries computed with the old weights;
    ``open_gate`` admits requests again; ``holds(record)`` is told each time the storage
    starts holding a committed record exactly (the gate reopened at it, or a dense refit
    restored it) -- for logs, version tags or checks.  The defaults do nothing.
    """

    close_gate: Hook = _nothing
    invalidate_kv_cache: Hook = _nothing
    open_gate: Hook = _nothing
    holds: Callable[[CommitRecord], Awaitable[None]] = _nothing_held


@dataclass(slots=True)
class ReceiverService:
    """One receiver endpoint: the protocol core, ingestion, decode and in-place apply."""

    name: str
    receiver: Applier
    integration: Integration
    control: ControlChannel
    transport: Transport
    held: CommitRecord | None
    """The committed record the storage holds, or ``None`` for a receiver that must first
    restore one by dense refit."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    hooks: ReceiverHooks = field(default_factory=ReceiverHooks)
    limiter: anyio.CapacityLimiter = field(default_factory=default_limiter)
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    on_applied: Callable[[PayloadKey], None] | None = None
    """Called (in a worker thread) after each payload applied in place (faults, progress)."""
    fleet_secret: bytes | None = field(default=None, repr=False)
    """The fleet's 32-byte secret: every payload must carry a keyed seal under its payload key
    (:mod:`dcr.wire.seal`) -- an unkeyed payload fails its reception check ``unsealed``, a
    wrong seal ``digest`` -- verified before anything of the payload is decoded.  ``None``:
    unkeyed payloads are verified by their digest and keyed ones refused (``seal-key``)."""
    core: ReceiverCore = field(init=False)
    link: EndpointLink | None = None
    rejected: Counter[str] = field(default_factory=Counter)
    """Payloads this receiver refused at their reception checks, by check (``digest``,
    ``unsealed``, ``schema``, ...); each refusal fails the attempt or dense job it came in."""
    applied_payloads: int = 0
    decode_seconds: float = 0.0
    apply_seconds: float = 0.0
    _owner_names: dict[int, str] = field(default_factory=dict)
    _deliveries: dict[int, Delivery] = field(default_factory=dict)
    """Bytes of deliveries the core has not staged or discarded yet, by delivery number."""
    _unacked: set[int] = field(default_factory=set)
    _checked: dict[int, Payload] = field(default_factory=dict)
    _bytes: dict[PayloadKey, bytes] = field(default_factory=dict)
    _decoded: dict[PayloadKey, Payload] = field(default_factory=dict)
    _events: MemoryObjectSendStream[object] | None = None
    _count: int = 0
    _seal_key: bytes | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._seal_key = payload_key(self.fleet_secret)
        self.core = ReceiverCore(
            self.name,
            held=self.held,
            queue=self.queue,
            arrival_grace_s=self.transport.arrival_grace_s,
            window=self.transport.receiver_window,
        )
        self._owner_names = {i: n for n, i in self.integration.owner_ids.items()}

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve control calls and payloads until cancelled."""
        link = self.link = await self.control.endpoint(self.name)
        deliveries = self.transport.subscribe(self.name)
        send, recv = anyio.create_memory_object_stream[object](math.inf)
        self._events = send
        try:
            with send, recv:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._forward, link.calls())
                    tg.start_soon(self._ingest, deliveries)
                    await self._report_status()
                    task_status.started()
                    async for message in recv:
                        await self._handle(message, tg)
        finally:
            with anyio.CancelScope(shield=True):
                self.transport.unsubscribe(self.name)
                await link.aclose()

    async def dense_refit(
        self, state_dict: Mapping[str, torch.Tensor], record: CommitRecord
    ) -> None:
        """Restore ``record`` by a local dense load through the native loader (a supervisor
        that holds the canonical tensors); over a fleet the owners send a dense refit."""
        await anyio.to_thread.run_sync(self.receiver.dense_load, state_dict, limiter=self.limiter)
        await self._local(ev.DenseRefitDone(record=record))

    def refused(self) -> frozenset[str] | None:
        """The canonical names this receiver's native loader path does not preserve bit for
        bit (the catalog less :meth:`Applier.xor_allowed`): they must travel as overwrites.
        ``None`` before prewarm."""
        if not self.receiver.paths:
            return None
        return frozenset(self.receiver.catalog).difference(self.receiver.xor_allowed())

    def _reported_refused(self) -> frozenset[str] | None:
        """What the status report carries: :meth:`refused`, unless it is larger than a
        control message carries (then none, and the integration setup's ``xor_names``
        decide what owners send relative)."""
        refused = self.refused()
        if refused is None or msg.refused_size(refused) > msg.XOR_REFUSED_MAX_BYTES:
            return None
        return refused

    async def _report_status(self) -> None:
        if self.link is not None:
            await self.link.set_status(
                msg.EndpointStatus(
                    endpoint=self.name,
                    role="receiver",
                    incarnation=self.incarnation,
                    record=None if self.core.dirty else self.core.held,
                    xor_refused=self._reported_refused(),
                )
            )

    # -- plumbing ---------------------------------------------------------------------------

    async def _forward(self, calls: AsyncIterator[msg.Call]) -> None:
        async for message in calls:
            await self._local(message)

    async def _local(self, event: object) -> None:
        assert self._events is not None
        await self._events.send(event)

    async def _ingest(self, deliveries: AsyncIterator[Delivery]) -> None:
        """Number each delivery and report it; the core decides when to read it."""
        async for d in deliveries:
            self._count += 1
            self._deliveries[self._count] = d
            self._unacked.add(self._count)
            await self._local(
                ev.PayloadReceived(delivery=self._count, key=d.key, addressed=d.addressed)
            )

    async def _handle(self, message: object, tg: TaskGroup) -> None:
        event = message
        if isinstance(message, msg.Prepare):
            if message.proof is not None:
                # Reading the proof back from storage is CPU work: a worker thread answers.
                tg.start_soon(self._prove, message)
                return
            event = ev.PrepareChecked(info=message.info, rejection=self._prepare_check(message))
        for c in self.core.handle(event):  # type: ignore[arg-type]
            await self._execute(c, tg)
        if isinstance(message, msg.Disproved):
            await self._report_status()

    async def _prove(self, message: msg.Prepare) -> None:
        """The prepare check plus this receiver's proof of the base version."""
        assert message.proof is not None
        rejection = self._prepare_check(message)
        proof = None
        if rejection is None:
            try:
                proof = await anyio.to_thread.run_sync(
                    receiver_proof, self.receiver, message.proof, limiter=self.limiter
                )
            except DcrError:
                proof = None  # no proof: the coordinator's verdict fails this receiver
        await self._local(ev.PrepareChecked(info=message.info, rejection=rejection, proof=proof))

    def _prepare_check(self, message: msg.Prepare) -> str | None:
        """The engine's metadata and loader-classification check at prepare (a *reject*): in
        mixed mode every name the attempt may encode relative -- the catalog less the
        prepare's ``xor_refused``, or the integration setup's ``xor_names`` when it binds
        none -- must be one this receiver's loader allows."""
        if not self.receiver.paths:
            return "prewarm"
        if message.info.mode is Mode.MIXED:
            relative = (
                self.integration.xor_names
                if message.xor_refused is None
                else frozenset(self.integration.catalog).difference(message.xor_refused)
            )
            if not relative <= self.receiver.xor_allowed():
                return "classification"
        try:
            self.receiver.loader.check_ready()
        except DcrError:
            return "classification"
        return None

    async def _check(self, delivery: int) -> None:
        """Reception checks on the bytes (paper App. B.1) -> ``PayloadArrived``."""
        d = self._deliveries.get(delivery)
        if d is None:
            return
        key = d.key
        rejection: str | None = None
        detail = ""
        final = False
        try:
            payload = await anyio.to_thread.run_sync(self._decode, d.data, limiter=self.limiter)
            # The payload's own 128-bit digest of every other byte, verified by the decoder: it
            # tells a duplicate with other bytes apart without hashing the payload again.
            digest = bytes(memoryview(d.data)[DIGEST_OFFSET:HEADER_SIZE])
            h = payload.header
            final = h.final
            if (h.attempt, self._owner_names.get(h.owner), h.payload_id) != (
                key.attempt,
                key.owner,
                key.payload_id,
            ):
                rejection = "schema"
                detail = "the header names another attempt, owner or payload than its delivery"
                self.rejected[rejection] += 1
            else:
                self._checked[delivery] = payload
        except PayloadRejected as exc:
            digest = hashlib.blake2b(d.data, digest_size=16).digest()
            rejection = exc.check or "schema"
            detail = str(exc)
            self.rejected[rejection] += 1
            if rejection in _CATALOG_CHECKS:
                # Deterministic: every attempt of these owners will fail the same way.
                detail = f"the owners' catalog differs from this receiver's: {detail}"
        arrived = ev.PayloadArrived(
            delivery=delivery, key=key, digest=digest, final=final, rejection=rejection,
            detail=detail,
        )  # fmt: skip
        await self._local(arrived)

    def _decode(self, data: bytes) -> Payload:
        t0 = time.perf_counter()
        try:
            return decode_payload(
                data,
                catalog=self.integration.catalog,
                limits=self.integration.limits,
                xor_allowed=self.receiver.xor_allowed(),
                seal_key=self._seal_key,
            )
        finally:
            self.decode_seconds += time.perf_counter() - t0

    async def _ack(self, delivery: int, key: PayloadKey) -> None:
        if delivery in self._unacked:
            self._unacked.discard(delivery)
            await self.transport.taken(self.name, key)

    # -- commands ---------------------------------------------------------------------------

    async def _execute(self, c: cmd.ReceiverCommand, tg: TaskGroup) -> None:
        match c:
            case cmd.Notify(message=message):
                assert self.link is not None
                await self.link.notify(message)
                if isinstance(message, msg.ReceiverReady):
                    await self.hooks.holds(message.record)
                    await self._report_status()
            case cmd.CheckPayload(delivery=delivery):
                d = self._deliveries.get(delivery)
                if d is not None:
                    await self._ack(delivery, d.key)
                    tg.start_soon(self._check, delivery)
            case cmd.Acknowledge(delivery=delivery):
                d = self._deliveries.get(delivery)
                if d is not None:
                    await self._ack(delivery, d.key)
            case cmd.Discard(delivery=delivery):
                d = self._deliveries.pop(delivery, None)
                self._checked.pop(delivery, None)
                if d is not None:
                    await self._ack(delivery, d.key)
            case cmd.StagePayload(key=key, delivery=delivery, keep_decoded=keep):
                self._bytes[key] = self._deliveries.pop(delivery).data
                payload = self._checked.pop(delivery, None)
                if payload is not None and keep:
                    self._decoded[key] = payload
            case cmd.Decode(key=key):
                tg.start_soon(self._decode_staged, key)
            case cmd.Apply(attempt=tau, keys=keys):
                tg.start_soon(self._apply, tau, keys)
            case cmd.CloseGate(attempt=tau):
                tg.start_soon(self._close_gate, tau)
            case cmd.Synchronize(attempt=tau):
                tg.start_soon(self._synchronize, tau)
            case cmd.InvalidateKvCache():
                await self.hooks.invalidate_kv_cache()
            case cmd.OpenGate():
                if self.core.held is not None:
                    await self.hooks.holds(self.core.held)
                await self.hooks.open_gate()
                await self._report_status()
            case cmd.ArmDeadline(attempt=tau, stage=stage, seconds=seconds):
                tg.start_soon(self._timer, ev.DeadlineExpired(attempt=tau, stage=stage), seconds)
            case cmd.Release(attempt=tau):
                for store in (self._bytes, self._decoded):
                    for key in [k for k in store if k.attempt == tau]:
                        del store[key]
                for delivery in [n for n, d in self._deliveries.items() if d.key.attempt == tau]:
                    d = self._deliveries.pop(delivery)
                    self._checked.pop(delivery, None)
                    await self._ack(delivery, d.key)

    async def _timer(self, event: ev.DeadlineExpired, seconds: float) -> None:
        await anyio.sleep(seconds)
        await self._local(event)

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
        """Apply a group in order; each payload is checked and planned while the one before
        it is written (:meth:`Applier.apply_payloads`)."""

        def applied(i: int) -> None:
            self._bytes.pop(keys[i], None)
            self.applied_payloads += 1
            if self.on_applied is not None:
                self.on_applied(keys[i])

        t0 = time.perf_counter()
        try:
            self.receiver.apply_payloads(
                (self._decoded.pop(key).items for key in keys), attempt=attempt, on_applied=applied
            )
        finally:
            self.apply_seconds += time.perf_counter() - t0

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
        await self.hooks.close_gate()
        await self._local(ev.RequestsDrained(attempt=attempt))

    async def _synchronize(self, attempt: int) -> None:
        device = self.receiver.device
        if device.type == "cuda":
            await anyio.to_thread.run_sync(torch.cuda.synchronize, device, limiter=self.limiter)
        await self._local(ev.Synchronized(attempt=attempt))


@asynccontextmanager
async def open_receiver(**options: Any) -> AsyncIterator[ReceiverService]:
    """Build a :class:`ReceiverService` from ``options`` (its fields) and serve it for the duration
    of the block, in a task group of its own::

        async with open_receiver(name=..., ...) as service:
            ...
    """
    async with serving(ReceiverService(**options)) as service:
        yield service
