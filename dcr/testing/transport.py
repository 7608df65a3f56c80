"""A conformance suite for transports: :class:`TransportTests`, the base of a pytest test class.

Every ``test_*`` method of :class:`TransportTests` drives a fresh world of the transport -- a
:class:`TransportHarness`: the sender side of owners, the side a receiver's process
subscribes on, the coordinator's side, and a way to make a receiver vanish -- and asserts the
semantics of :mod:`dcr.adapters.transport.base`: delivery to every subscriber and to ``to``
subsets, per-owner order, identical and conflicting duplicates delivered and counted
(V_cross / V_payload, paper §7.1), ``stop_and_wait`` and ``cleanup`` (paper App. B.2), the
arrival check within ``arrival_grace_s`` (App. B.1), bounded memory under a receiver that
stops taking (transports with credit), and the loss of a receiver.

A transport's test module subclasses it::

    class TestMyTransport(TransportTests):
        async def make_transport(self) -> Transport:
            return MyTransport(...)        # what one process of a deployment opens

:meth:`TransportTests.make_transport` builds the world as processes would
(:class:`ProcessHarness`: each owner and the coordinator a transport object of its own, the
receivers one more, their node's; ``shared = True`` when one object serves every process, as
an in-process transport does).  A world with more parts (relay nodes to start, receivers to
place on them) overrides :meth:`TransportTests.make_harness` instead.  Two capability flags
say which properties a transport has by design -- ``credit`` (a receiver that stops taking
blocks senders) and ``keeps_sent_at_cleanup`` (cleanup does not take back payloads whose send
returned); the checks of a property the transport lacks are skipped, with the reason.  dcr's
own transports run the suite in ``tests/adapters/test_transport_*.py``.
"""

from __future__ import annotations

import random
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar, Protocol, Self

import anyio
import anyio.abc
import pytest

from dcr.adapters.transport.base import Delivery, Transport, TransportStats
from dcr.errors import TransportError
from dcr.protocol.types import PayloadKey
from dcr.testing.conformance import AsyncSuite, until

__all__ = ["HeldLike", "Inbox", "ProcessHarness", "TransportHarness", "TransportTests"]

SIZE = 32 << 10
"""Payload size the checks use (small: the suite runs on two CPU cores)."""
SLACK_S = 0.25
"""Scheduling slack on top of ``arrival_grace_s`` before a payload counts as late."""
PROMPT_S = 30.0
"""How long a step that takes milliseconds (a send that nothing holds up, a delivery) may take
before a check fails: generous for a loaded machine, where an S3 request can wait seconds."""


class HeldLike(Protocol):
    """What one place (a relay node, a receiver's window) holds of payloads, and its bound."""

    @property
    def count(self) -> int: ...
    @property
    def peak_count(self) -> int: ...
    @property
    def peak_bytes(self) -> int: ...
    @property
    def max_count(self) -> int: ...
    @property
    def max_bytes(self) -> int: ...


class TransportHarness(ABC):
    """One world of a transport implementation, entered with ``async with``.

    Transports the harness hands out are its own: it closes them when the block ends.
    """

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abstractmethod
    async def sender(self, owner: str) -> Transport:
        """The transport ``owner``'s process sends on."""

    @abstractmethod
    async def receiver(self, name: str) -> Transport:
        """The transport the process hosting receiver ``name`` subscribes on."""

    @abstractmethod
    async def controller(self) -> Transport:
        """The transport the coordinator calls ``stop_and_wait`` and ``cleanup`` on."""

    @abstractmethod
    async def vanish(self, name: str) -> None:
        """Receiver ``name``'s process disappears without unsubscribing."""

    @abstractmethod
    def boundary_stats(self) -> TransportStats:
        """V_cross and V_payload where payloads cross into the rollout side."""

    async def settle(self, receivers: Collection[str]) -> None:  # noqa: B027 - optional hook
        """Return once payloads sent from now on reach every receiver in ``receivers``."""

    def held(self) -> Mapping[str, HeldLike]:
        """Payload memory per place, for the back-pressure bound (none by default)."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Close everything the harness opened."""


class ProcessHarness(TransportHarness):
    """A world opened as a deployment's processes open the transport: every owner and the
    coordinator get a transport object of their own from ``make``; all receivers subscribe on
    one more, from ``make_node`` (default ``make``): one rollout node, whose process they
    share.  With ``shared`` one object plays every part (an in-process transport).

    A receiver vanishes by its node unsubscribing it.  V_cross and V_payload are what the
    senders' objects counted (``stats()``); a transport that counts them where payloads
    arrive overrides :meth:`boundary_stats`.
    """

    def __init__(
        self,
        make: Callable[[], Awaitable[Transport]],
        *,
        make_node: Callable[[], Awaitable[Transport]] | None = None,
        shared: bool = False,
    ) -> None:
        self.make = make
        self.make_node = make_node or make
        self.shared = shared
        self.opened: list[Transport] = []
        self.senders: dict[str, Transport] = {}
        self.node: Transport | None = None
        self.names: set[str] = set()

    async def _new(self, make: Callable[[], Awaitable[Transport]]) -> Transport:
        if self.shared and self.opened:
            return self.opened[0]
        transport = await make()
        self.opened.append(transport)
        return transport

    async def sender(self, owner: str) -> Transport:
        if owner not in self.senders:
            self.senders[owner] = await self._new(self.make)
        return self.senders[owner]

    async def receiver(self, name: str) -> Transport:
        if self.node is None:
            self.node = await self._new(self.make_node)
        self.names.add(name)
        return self.node

    async def controller(self) -> Transport:
        return await self._new(self.make)

    async def vanish(self, name: str) -> None:
        assert self.node is not None
        self.node.unsubscribe(name)

    def boundary_stats(self) -> TransportStats:
        if self.shared:
            return self.opened[0].stats()
        counted = [t.stats() for t in self.senders.values()]
        return TransportStats(
            payloads=sum(s.payloads for s in counted),
            payload_bytes=sum(s.payload_bytes for s in counted),
            cross_bytes=sum(s.cross_bytes for s in counted),
        )

    async def aclose(self) -> None:
        if self.node is not None:
            for name in self.names:
                self.node.unsubscribe(name)
        for transport in self.opened:
            await transport.aclose()


@dataclass(slots=True, eq=False)
class Inbox:
    """A receiver that records its deliveries and takes each one unless paused."""

    name: str
    transport: Transport
    got: list[Delivery] = field(default_factory=list)
    arrived: dict[PayloadKey, list[float]] = field(default_factory=dict)
    taking: anyio.Event = field(default_factory=anyio.Event)
    ended: bool = False

    async def run(self, deliveries: AsyncIterator[Delivery]) -> None:
        try:
            async for d in deliveries:
                self.got.append(d)
                self.arrived.setdefault(d.key, []).append(time.monotonic())
                await self.taking.wait()
                await self.transport.taken(self.name, d.key)
        except anyio.ClosedResourceError:
            pass  # a memory-object stream closed by ``unsubscribe`` also ends the deliveries
        self.ended = True

    def pause(self) -> None:
        self.taking = anyio.Event()

    def resume(self) -> None:
        self.taking.set()

    def received(self) -> list[PayloadKey]:
        return [d.key for d in self.got]


def _bytes(key: PayloadKey, size: int = SIZE, salt: int = 0) -> bytes:
    seed = zlib.crc32(f"{key.attempt}/{key.owner}/{key.payload_id}/{salt}".encode())
    return random.Random(seed).randbytes(size)


def _key(attempt: int, owner: str, payload_id: int) -> PayloadKey:
    return PayloadKey(attempt=attempt, owner=owner, payload_id=payload_id)


def _count_at_least(inbox: Inbox, n: int) -> Callable[[], bool]:
    return lambda: len(inbox.got) >= n


def _has(inbox: Inbox, key: PayloadKey) -> Callable[[], bool]:
    return lambda: key in inbox.arrived


async def _inboxes(
    h: TransportHarness, tg: anyio.abc.TaskGroup, names: Collection[str], *, paused: bool = False
) -> dict[str, Inbox]:
    out = {}
    for name in names:
        inbox = Inbox(name=name, transport=await h.receiver(name))
        if not paused:
            inbox.resume()
        tg.start_soon(inbox.run, inbox.transport.subscribe(name))
        out[name] = inbox
    await h.settle(names)
    return out


async def _send_all(
    transport: Transport, keys: list[PayloadKey], outcome: dict[PayloadKey, BaseException | None]
) -> None:
    """Start a send of every key at once, in list order; record each outcome as it comes."""

    async def one(key: PayloadKey) -> None:
        try:
            await transport.send(key, _bytes(key))
            outcome[key] = None
        except TransportError as exc:
            outcome[key] = exc

    async with anyio.create_task_group() as tg:
        for key in keys:
            tg.start_soon(one, key)


def _assert_stopped(exc: BaseException | None, attempt: int) -> None:
    assert isinstance(exc, TransportError), f"expected a refused send, got {exc!r}"
    assert exc.retryable is False and exc.check == "stopped" and exc.attempt == attempt, exc


def _assert_bounded(h: TransportHarness) -> None:
    places = h.held()
    assert places, "a transport with credit reports what each place holds"
    for place, held in places.items():
        assert held.peak_count <= held.max_count, f"{place}: {held}"
        assert held.peak_bytes <= held.max_bytes, f"{place}: {held}"


class TransportTests(AsyncSuite):
    """The transport conformance suite; subclass it as ``Test<YourTransport>``.

    Provide :meth:`make_transport` (or :meth:`make_harness`); set the capability flags the
    transport does not have to ``False``, with a comment saying why.
    """

    credit: ClassVar[bool] = True
    """Whether the transport bounds what is in flight with the receivers' queueing ACKs
    (:meth:`~dcr.adapters.transport.base.Transport.taken`): a receiver that stops taking
    blocks senders, and the harness reports every place's bound (:meth:`TransportHarness.
    held`).  ``False`` skips ``test_back_pressure_bound`` (e.g. object storage decouples the
    sides; an in-memory transport queues without bound)."""
    keeps_sent_at_cleanup: ClassVar[bool] = True
    """Whether payloads whose ``send`` returned still reach their receivers after ``cleanup``
    of their attempt.  ``False`` (a store that deletes an attempt's objects at cleanup,
    before receivers fetched them) skips ``test_cleanup``; such a transport checks its
    cleanup in tests of its own."""
    shared: ClassVar[bool] = False
    """Whether one transport object serves every process (the default harness then builds
    one object only)."""

    async def make_transport(self) -> Transport:
        """A new transport object, as one more process of a deployment opens it."""
        raise NotImplementedError(
            f"{type(self).__name__} must define make_transport() or make_harness()"
        )

    def make_harness(self) -> TransportHarness:
        """A fresh world of the transport (default: :class:`ProcessHarness` over
        :meth:`make_transport`)."""
        return ProcessHarness(self.make_transport, shared=self.shared)

    def check_world(self, harness: TransportHarness) -> None:
        """Called after every check, the world still open: the adapter's own invariants (no
        dropped frames, no damaged fetches).  Nothing by default."""

    @asynccontextmanager
    async def world(self) -> AsyncIterator[TransportHarness]:
        """A fresh harness for one check, the check bounded by :attr:`timeout_s`."""
        async with self.make_harness() as harness:
            with anyio.fail_after(self.timeout_s):
                yield harness
            self.check_world(harness)

    # -- the checks -----------------------------------------------------------------------------

    async def test_delivery_to_every_subscriber(self) -> None:
        """Every payload reaches every subscribed receiver exactly once, with its bytes; for a
        fault-free attempt V_cross == V_payload == the bytes sent."""
        names = ("r0", "r1", "r2")
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, names)
            owners = {o: await h.sender(o) for o in ("o0", "o1")}
            sent: dict[PayloadKey, bytes] = {}

            async def stream(owner: str) -> None:
                for pid in range(5):
                    key = _key(1, owner, pid)
                    sent[key] = _bytes(key, SIZE + pid)
                    await owners[owner].send(key, sent[key])

            async with anyio.create_task_group() as senders:
                for owner in owners:
                    senders.start_soon(stream, owner)
            for inbox in inboxes.values():
                await until(_count_at_least(inbox, len(sent)), PROMPT_S, f"{inbox.name}'s payloads")
            await anyio.sleep(SLACK_S)
            for inbox in inboxes.values():
                assert sorted(inbox.received()) == sorted(sent), inbox.name
                assert all(d.data == sent[d.key] for d in inbox.got), inbox.name
            total = sum(len(b) for b in sent.values())
            stats = h.boundary_stats()
            assert stats.payloads == len(sent)
            assert stats.cross_bytes == stats.payload_bytes == total, stats
            tg.cancel_scope.cancel()

    async def test_delivery_to_named_receivers(self) -> None:
        """``to`` limits delivery to the named receivers; an empty set and names that never
        subscribe are not waited for forever (a transport may hold a payload a bounded while
        for a named receiver that is still subscribing); receivers not named never see it."""
        names = ("r0", "r1", "r2")
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, names)
            owner = await h.sender("o0")
            plan = {
                _key(1, "o0", 0): frozenset({"r1"}),
                _key(1, "o0", 1): frozenset({"r0", "r2"}),
                _key(1, "o0", 2): frozenset(),
                _key(1, "o0", 3): frozenset({"ghost"}),
                _key(1, "o0", 4): frozenset({"r2", "ghost"}),
            }
            for key, to in plan.items():
                with anyio.fail_after(PROMPT_S):
                    await owner.send(key, _bytes(key), to=to)
            for name, inbox in inboxes.items():
                want = sorted(k for k, to in plan.items() if name in to)
                await until(_count_at_least(inbox, len(want)), PROMPT_S, f"{name}'s payloads")
            await anyio.sleep(SLACK_S)
            for name, inbox in inboxes.items():
                assert sorted(inbox.received()) == sorted(
                    k for k, to in plan.items() if name in to
                ), name
            tg.cancel_scope.cancel()

    async def test_owner_order(self) -> None:
        """Payloads of one owner, sent concurrently, reach each receiver in the order sent."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"))
            owner = await h.sender("o0")
            keys = [_key(1, "o0", pid) for pid in range(12)]
            outcome: dict[PayloadKey, BaseException | None] = {}
            await _send_all(owner, keys, outcome)
            assert all(v is None for v in outcome.values()), outcome
            for inbox in inboxes.values():
                await until(_count_at_least(inbox, len(keys)), PROMPT_S, f"{inbox.name}'s payloads")
                assert inbox.received() == keys, inbox.name
            tg.cancel_scope.cancel()

    async def test_duplicates_delivered_and_counted(self) -> None:
        """An identical and a conflicting re-send are both delivered (receivers deduplicate or
        fail the attempt); V_payload counts the key once, V_cross every copy."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"))
            owner = await h.sender("o0")
            key = _key(1, "o0", 0)
            first, other = _bytes(key), _bytes(key, SIZE + 7, salt=1)
            for data in (first, first, other):
                with anyio.fail_after(PROMPT_S):
                    await owner.send(key, data)
            for inbox in inboxes.values():
                await until(_count_at_least(inbox, 3), PROMPT_S, f"{inbox.name}'s copies")
                assert [d.data for d in inbox.got] == [first, first, other], inbox.name
            stats = h.boundary_stats()
            assert stats.payloads == 1
            assert stats.payload_bytes == len(first)
            assert stats.cross_bytes == 2 * len(first) + len(other) > stats.payload_bytes
            tg.cancel_scope.cancel()

    async def test_stop_and_wait(self) -> None:
        """``stop_and_wait`` returns while a receiver is stuck; sends of the attempt then either
        completed or were refused (``retryable=False``), later sends of it are refused, nothing
        of it is held anywhere, and other attempts are unaffected."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"), paused=True)
            inboxes["r1"].resume()
            owner, control = await h.sender("o0"), await h.controller()
            keys = [_key(1, "o0", pid) for pid in range(4)]
            outcome: dict[PayloadKey, BaseException | None] = {}

            tg.start_soon(_send_all, owner, keys, outcome)
            await anyio.sleep(0.3)
            with anyio.fail_after(PROMPT_S):
                await control.stop_and_wait(1)
            await until(lambda: len(outcome) == len(keys), PROMPT_S, "the stopped attempt's sends")
            for exc in outcome.values():
                if exc is not None:
                    _assert_stopped(exc, 1)
            for place, held in h.held().items():
                assert held.count == 0, f"{place} still holds {held.count} payloads"
            try:
                await owner.send(_key(1, "o0", 9), b"late")
            except TransportError as exc:
                _assert_stopped(exc, 1)
            else:
                raise AssertionError("a send of a stopped attempt was accepted")
            inboxes["r0"].resume()
            key2 = _key(2, "o0", 0)
            with anyio.fail_after(PROMPT_S):
                await owner.send(key2, _bytes(key2))
            for inbox in inboxes.values():
                await until(_has(inbox, key2), PROMPT_S, f"{inbox.name}'s next attempt")
                stale = [k for k in inbox.received() if k.attempt == 1]
                assert set(stale) <= set(keys) and len(set(stale)) == len(stale), inbox.name
            tg.cancel_scope.cancel()

    async def test_cleanup(self) -> None:
        """``cleanup`` releases the attempt (nothing held, later sends refused), is idempotent,
        accepts attempts the transport never saw, and leaves other attempts alone."""
        if not self.keeps_sent_at_cleanup:
            pytest.skip(
                f"{type(self).__name__}.keeps_sent_at_cleanup is False: cleanup takes back "
                "payloads receivers have not fetched yet"
            )
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"))
            owner, control = await h.sender("o0"), await h.controller()
            keys = [_key(3, "o0", pid) for pid in range(3)]
            for key in keys:
                with anyio.fail_after(PROMPT_S):
                    await owner.send(key, _bytes(key))
            with anyio.fail_after(PROMPT_S):
                await control.cleanup(3)
                await control.cleanup(3)
                await control.cleanup(99)
            for place, held in h.held().items():
                assert held.count == 0, f"{place} still holds {held.count} payloads"
            try:
                await owner.send(_key(3, "o0", 5), b"late")
            except TransportError as exc:
                _assert_stopped(exc, 3)
            else:
                raise AssertionError("a send of a cleaned-up attempt was accepted")
            key4 = _key(4, "o0", 0)
            with anyio.fail_after(PROMPT_S):
                await owner.send(key4, _bytes(key4))
            for inbox in inboxes.values():
                await until(_has(inbox, key4), PROMPT_S, f"{inbox.name}'s next attempt")
                assert inbox.received() == [*keys, key4], inbox.name
            tg.cancel_scope.cancel()

    async def test_arrival_within_grace(self) -> None:
        """After ``send`` returned, the payload reaches every subscribed receiver within the
        transport's ``arrival_grace_s`` (the receivers' arrival check at flush relies on it)."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"))
            owner = await h.sender("o0")
            returned: dict[PayloadKey, float] = {}
            for pid in range(5):
                key = _key(1, "o0", pid)
                with anyio.fail_after(PROMPT_S):
                    await owner.send(key, _bytes(key))
                returned[key] = time.monotonic()
            grace = owner.arrival_grace_s
            for inbox in inboxes.values():
                await until(_count_at_least(inbox, len(returned)), grace + PROMPT_S, "arrivals")
                for key, t in returned.items():
                    late = inbox.arrived[key][0] - t
                    assert late <= grace + SLACK_S, f"{key} reached {inbox.name} {late:.2f} s late"
            tg.cancel_scope.cancel()

    async def test_back_pressure_bound(self) -> None:
        """A receiver that stops taking blocks concurrent senders, every place stays within its
        bound meanwhile, and everything completes once it takes again."""
        if not self.credit:
            pytest.skip(f"{type(self).__name__}.credit is False: a send never waits for receivers")
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"), paused=True)
            inboxes["r1"].resume()
            owners = {o: await h.sender(o) for o in ("o0", "o1", "o2")}
            plan = {o: [_key(1, o, pid) for pid in range(6)] for o in owners}
            done: dict[PayloadKey, BaseException | None] = {}

            for owner, keys in plan.items():
                tg.start_soon(_send_all, owners[owner], keys, done)
            await anyio.sleep(1.0)
            assert not done, f"{len(done)} sends completed although r0 takes nothing"
            _assert_bounded(h)
            inboxes["r0"].resume()
            total = sum(len(keys) for keys in plan.values())
            await until(lambda: len(done) == total, PROMPT_S, "the blocked sends")
            assert all(v is None for v in done.values()), done
            for inbox in inboxes.values():
                await until(_count_at_least(inbox, total), PROMPT_S, f"{inbox.name}'s payloads")
                for keys in plan.values():
                    assert [k for k in inbox.received() if k.owner == keys[0].owner] == keys
            _assert_bounded(h)
            tg.cancel_scope.cancel()

    async def test_receiver_vanishes(self) -> None:
        """A receiver that vanishes while sends wait for it stops being waited for: the sends
        complete for the others, and later sends too."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"), paused=True)
            inboxes["r1"].resume()
            owner = await h.sender("o0")
            keys = [_key(1, "o0", pid) for pid in range(3)]
            outcome: dict[PayloadKey, BaseException | None] = {}

            tg.start_soon(_send_all, owner, keys, outcome)
            await anyio.sleep(0.3)
            await h.vanish("r0")
            await until(
                lambda: len(outcome) == len(keys), PROMPT_S, "sends after the receiver vanished"
            )
            assert all(v is None for v in outcome.values()), outcome
            key = _key(1, "o0", 3)
            with anyio.fail_after(PROMPT_S):
                await owner.send(key, _bytes(key))
            await until(lambda: len(inboxes["r1"].got) >= 4, PROMPT_S, "r1's payloads")
            assert inboxes["r1"].received() == [*keys, key]
            tg.cancel_scope.cancel()

    async def test_unsubscribe(self) -> None:
        """``unsubscribe`` ends the receiver's deliveries; later sends neither reach nor wait
        for it."""
        async with self.world() as h, anyio.create_task_group() as tg:
            inboxes = await _inboxes(h, tg, ("r0", "r1"))
            owner = await h.sender("o0")
            first = _key(1, "o0", 0)
            with anyio.fail_after(PROMPT_S):
                await owner.send(first, _bytes(first))
            await until(lambda: first in inboxes["r0"].arrived, PROMPT_S, "r0's first payload")
            inboxes["r0"].transport.unsubscribe("r0")
            await until(lambda: inboxes["r0"].ended, PROMPT_S, "the end of r0's deliveries")
            second = _key(1, "o0", 1)
            with anyio.fail_after(PROMPT_S):
                await owner.send(second, _bytes(second))
            await until(lambda: second in inboxes["r1"].arrived, PROMPT_S, "r1's second payload")
            assert inboxes["r0"].received() == [first]
            tg.cancel_scope.cancel()
