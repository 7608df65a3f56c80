"""A conformance suite for control channels: :class:`ControlTests`, the base of a pytest test class.

Every ``test_*`` method of :class:`ControlTests` drives a fresh world of a control channel -- a
:class:`ControlHarness`: one coordinator link and endpoint links opened as their own processes
would -- and asserts the rules of :mod:`dcr.adapters.control.base`: calls reach the named
endpoint in order, replies reach the coordinator, calls to an endpoint that is not connected
wait (at most ``PENDING_CALLS``, the oldest dropped and counted) and are delivered when it
connects, calls of an older coordinator epoch are refused and counted, duplicates are
delivered, a new link of a closed endpoint's name receives later calls, and ``aclose`` ends
iteration.  A channel's test module subclasses it -- ``class TestMyControl(ControlTests)`` --
and gives it :meth:`ControlTests.make_harness`; dcr's own channels run the suite in
``tests/adapters/test_control_*.py``.

:data:`EXAMPLES` holds one representative value of every control message, and
:func:`message_strategy` builds hypothesis strategies for any message class (codec tests).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
from hypothesis import strategies as st

from dcr.adapters.control.base import (
    PENDING_CALLS,
    SUPERVISOR_ONLY,
    CoordinatorLink,
    EndpointLink,
)
from dcr.protocol import messages as msg
from dcr.protocol.proof import Proof, ProofRequest, TensorProof
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode
from dcr.testing.conformance import AsyncSuite, until

__all__ = [
    "EXAMPLES",
    "ControlHarness",
    "ControlTests",
    "Inbox",
    "message_strategy",
]

_RECORD = CommitRecord(version=7, candidate="g7")
_INFO = AttemptInfo(
    attempt=(3 << 32) + 1,
    candidate="g3.1",
    base=_RECORD,
    mode=Mode.OVERWRITE,
    sync=False,
    coordinator=3,
    owners=("owner-0", "owner-1"),
    receivers=frozenset({"rx-2", "rx-0", "rx-1"}),
)
_COUNTS = (("owner-0", 3), ("owner-1", 0))

EXAMPLES: tuple[msg.Message, ...] = (
    msg.Prepare(
        info=_INFO,
        proof=ProofRequest(seed=(1 << 63) - 1, samples=64, fingerprint=True),
        xor_refused=frozenset({"model.norm.weight", "lm_head.weight"}),
    ),
    msg.StartStreaming(attempt=1),
    msg.WaitForRequests(attempt=2, epoch=3),
    msg.OpenApply(attempt=2, epoch=3),
    msg.CheckArrival(attempt=2, expected=_COUNTS),
    msg.Flush(attempt=2, expected=()),
    msg.MarkObsolete(attempt=2, epoch=3),
    msg.StopAndWait(attempt=2, epoch=3),
    msg.Cleanup(attempt=-1),
    msg.ReopenGate(attempt=2, epoch=3, record=_RECORD),
    msg.ReadRecord(),
    msg.DenseRefit(job=9, record=_RECORD, owners=("owner-0",), receivers=frozenset({"rx-1"})),
    msg.Disproved(attempt=2, epoch=3, reason="q_proj: fingerprint differs"),
    msg.PrepareAccepted(
        attempt=2,
        endpoint="rx-0",
        proof=Proof(
            seed=5,
            tensors=(
                TensorProof(name="q_proj", samples=(0, 65535, 3, 1), count=9, coverage=7, value=1),
            ),
            fingerprinted=True,
            excluded=("norm",),
        ),
    ),
    msg.PrepareRejected(attempt=2, endpoint="rx-0", check="shape", message="q_proj: ∅"),
    msg.AttemptFailed(attempt=2, endpoint="owner-1", check="digest"),
    msg.SendsDone(attempt=2, owner="owner-0", payload_count=1 << 40),
    msg.Staged(attempt=2, receiver="rx-1", counts=_COUNTS),
    msg.GateClosed(attempt=2, receiver="rx-1"),
    msg.Acked(attempt=2, receiver="rx-1", applied=_COUNTS, post_apply_checked=True),
    msg.Stopped(attempt=2, endpoint="rx-2", dirty=True),
    msg.Retired(attempt=2, endpoint="rx-2"),
    msg.BaselineUpdated(owner="owner-1", record=_RECORD),
    msg.ReceiverReady(receiver="rx-0", record=_RECORD),
    msg.EndpointStatus(
        endpoint="rx-0",
        role="receiver",
        incarnation="pid-41",
        record=None,
        xor_refused=frozenset({"model.layers.0.A_log", "model.norm.weight"}),
    ),
)
"""One representative value of every class in :data:`~dcr.protocol.messages.MESSAGES`:
nested records, enums, frozensets, tuples of pairs, optional and defaulted fields."""


def _speaking_for(reply: msg.Reply, name: str) -> msg.Reply:
    """``reply`` with its ``endpoint``/``receiver``/``owner`` field set to ``name``."""
    fields = {f.name for f in dataclasses.fields(reply)}
    changes: dict[str, Any] = {f: name for f in ("endpoint", "receiver", "owner") if f in fields}
    return dataclasses.replace(reply, **changes)


_CALL_EXAMPLES = tuple(m for m in EXAMPLES if isinstance(m, msg.CALLS))
_REPLY_EXAMPLES = tuple(
    _speaking_for(m, "ep-a")
    for m in EXAMPLES
    if isinstance(m, msg.REPLIES) and not isinstance(m, SUPERVISOR_ONLY)
)
"""Every reply an endpoint may send, as endpoint ``ep-a`` sends it (speaking for itself)."""

# -- hypothesis strategies for message classes ----------------------------------------------------

_INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
"""Every int MessagePack carries (msgspec: int64 and uint64)."""


def _strategy(tp: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is int:
        return _INT64
    if tp is str:
        return st.text(max_size=12)
    if tp is bool:
        return st.booleans()
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return message_strategy(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_strategy(args[0]), max_size=4).map(tuple)
        return st.tuples(*(_strategy(a) for a in args))
    if origin is frozenset:
        return st.frozensets(_strategy(args[0]), max_size=4)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in args))
    raise TypeError(f"no strategy for control message field type {tp!r}")


def message_strategy(cls: type) -> st.SearchStrategy[Any]:
    """Values of dataclass ``cls`` with every field drawn from its declared type (ints over
    the whole MessagePack range, any text, nested records, optional fields)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


# -- the harness -----------------------------------------------------------------------------------


class ControlHarness(ABC):
    """One world of a control channel, entered with ``async with``.

    Links the harness hands out are its own: it closes them when the block ends (closing a
    link twice must be harmless).
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
    async def coordinator(self) -> CoordinatorLink:
        """The world's coordinator link (the same one on every call)."""

    @abstractmethod
    async def endpoint(self, name: str) -> EndpointLink:
        """Open endpoint ``name``'s link as its own process would."""

    @abstractmethod
    def dropped_pending(self) -> int:
        """Calls dropped so far because ``PENDING_CALLS`` newer ones waited for their endpoint."""

    async def settle(  # noqa: B027 - optional hook
        self, *, connected: Collection[str] = (), disconnected: Collection[str] = ()
    ) -> None:
        """Return once calls to ``connected`` endpoints are delivered and calls to
        ``disconnected`` ones wait (channels that connect asynchronously need this)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Close everything the harness opened."""


@dataclass(slots=True, eq=False)
class Inbox:
    """Collects what one endpoint link's ``calls()`` yields, until the iteration ends."""

    link: EndpointLink
    got: list[msg.Call] = field(default_factory=list)
    ended: bool = False

    async def run(self) -> None:
        async for call in self.link.calls():
            self.got.append(call)
        self.ended = True


@dataclass(slots=True, eq=False)
class _Replies:
    """Collects what the coordinator link's ``replies()`` yields."""

    link: CoordinatorLink
    got: list[msg.Reply] = field(default_factory=list)
    ended: bool = False

    async def run(self) -> None:
        async for reply in self.link.replies():
            self.got.append(reply)
        self.ended = True


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 5 ms for at most ``timeout_s``."""
    await until(predicate, timeout_s, what, poll_s=0.005)


async def _inbox(h: ControlHarness, tg: anyio.abc.TaskGroup, name: str) -> Inbox:
    inbox = Inbox(link=await h.endpoint(name))
    tg.start_soon(inbox.run)
    return inbox


async def _collect(tg: anyio.abc.TaskGroup, coordinator: CoordinatorLink) -> _Replies:
    replies = _Replies(link=coordinator)
    tg.start_soon(replies.run)
    return replies


def _mark(attempt: int) -> msg.StartStreaming:
    return msg.StartStreaming(attempt=attempt)


def _attempts(calls: list[msg.Call]) -> list[int]:
    return [c.attempt for c in calls if isinstance(c, msg.StartStreaming)]


QUIET_S = 0.2
"""How long a check waits to see that something does *not* arrive."""


class ControlTests(AsyncSuite):
    """The control-channel conformance suite; subclass it as ``Test<YourChannel>`` and give it
    :meth:`make_harness`."""

    def make_harness(self) -> ControlHarness:
        """A fresh world of the channel."""
        raise NotImplementedError(f"{type(self).__name__} must define make_harness()")

    @asynccontextmanager
    async def world(self) -> AsyncIterator[ControlHarness]:
        """A fresh harness for one check, the check bounded by :attr:`timeout_s`."""
        async with self.make_harness() as harness:
            with anyio.fail_after(self.timeout_s):
                yield harness

    # -- the checks -----------------------------------------------------------------------------

    async def test_calls_in_order(self) -> None:
        """Calls reach exactly the named endpoint, in the order they were made, unchanged: every
        call type once, then interleaved numbered calls to two endpoints."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            async with anyio.create_task_group() as tg:
                a = await _inbox(h, tg, "ep-a")
                b = await _inbox(h, tg, "ep-b")
                await h.settle(connected=("ep-a", "ep-b"))
                for call in _CALL_EXAMPLES:
                    await coordinator.call("ep-a", call, epoch=3)
                for i in range(60):
                    await coordinator.call("ep-a" if i % 3 else "ep-b", _mark(i), epoch=3)
                n_a = len(_CALL_EXAMPLES) + 40
                await _until(lambda: len(a.got) >= n_a and len(b.got) >= 20, 10, "every call")
                await anyio.sleep(QUIET_S)
                assert a.got[: len(_CALL_EXAMPLES)] == list(_CALL_EXAMPLES)
                assert _attempts(a.got[len(_CALL_EXAMPLES) :]) == [i for i in range(60) if i % 3]
                assert _attempts(b.got) == [i for i in range(60) if not i % 3]
                assert len(a.got) == n_a and len(b.got) == 20
                tg.cancel_scope.cancel()

    async def test_replies_reach_coordinator(self) -> None:
        """Replies of every type reach the coordinator unchanged, each endpoint's in order."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            async with anyio.create_task_group() as tg:
                replies = await _collect(tg, coordinator)
                links = {name: await h.endpoint(name) for name in ("ep-a", "ep-b")}
                await h.settle(connected=links)
                for reply in _REPLY_EXAMPLES:
                    await links["ep-a"].notify(reply)
                for i in range(40):
                    name = "ep-a" if i % 2 else "ep-b"
                    await links[name].notify(
                        msg.AttemptFailed(attempt=i, endpoint=name, check="order")
                    )
                await _until(
                    lambda: len(replies.got) >= len(_REPLY_EXAMPLES) + 40, 10, "every reply"
                )
                examples = [r for r in replies.got if not isinstance(r, msg.AttemptFailed)]
                examples_failed = [r for r in _REPLY_EXAMPLES if isinstance(r, msg.AttemptFailed)]
                assert examples == [
                    r for r in _REPLY_EXAMPLES if not isinstance(r, msg.AttemptFailed)
                ]
                numbered = [r for r in replies.got if isinstance(r, msg.AttemptFailed)]
                assert [r for r in numbered if r.check != "order"] == examples_failed
                for name, parity in (("ep-a", 1), ("ep-b", 0)):
                    got = [r.attempt for r in numbered if r.check == "order" and r.endpoint == name]
                    assert got == [i for i in range(40) if i % 2 == parity], (name, got)
                tg.cancel_scope.cancel()

    async def test_a_reply_speaks_for_its_sender_only(self) -> None:
        """A reply naming another endpoint, and ``Retired`` (which only a supervisor reports),
        never reach the coordinator from an endpoint link; the link's next reply does."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            async with anyio.create_task_group() as tg:
                replies = await _collect(tg, coordinator)
                link = await h.endpoint("ep-m")
                await h.settle(connected=("ep-m",))
                forged = msg.Acked(attempt=5, receiver="ep-r", applied=(), post_apply_checked=True)
                await link.notify(forged)
                await link.notify(msg.Retired(attempt=5, endpoint="ep-m"))
                await link.notify(
                    msg.EndpointStatus(
                        endpoint="ep-r", role="receiver", incarnation="i1", record=None
                    )
                )
                honest = msg.GateClosed(attempt=5, receiver="ep-m")
                await link.notify(honest)
                await _until(lambda: honest in replies.got, 10, "the honest reply")
                assert replies.got == [honest]
                drops = coordinator.drops + link.drops
                assert drops["impersonation"] == 2 and drops["supervisor-only"] == 1
                tg.cancel_scope.cancel()

    async def test_status_reaches_coordinator(self) -> None:
        """``set_status`` records the status on the link and the coordinator receives it."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            status = msg.EndpointStatus(
                endpoint="ep-s", role="owner", incarnation="i1", record=_RECORD
            )
            async with anyio.create_task_group() as tg:
                replies = await _collect(tg, coordinator)
                link = await h.endpoint("ep-s")
                await h.settle(connected=("ep-s",))
                await link.set_status(status)
                assert link.status == status
                await _until(lambda: status in replies.got, 10, "the endpoint's status")
                tg.cancel_scope.cancel()

    async def test_pending_until_connect(self) -> None:
        """Calls to an endpoint that is not connected yet are delivered, in order, once it is."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            for i in range(5):
                await coordinator.call("ep-late", _mark(i), epoch=1)
            async with anyio.create_task_group() as tg:
                inbox = await _inbox(h, tg, "ep-late")
                await _until(lambda: len(inbox.got) >= 5, 10, "the waiting calls")
                await coordinator.call("ep-late", _mark(5), epoch=1)
                await _until(lambda: len(inbox.got) >= 6, 10, "a call after connecting")
                await anyio.sleep(QUIET_S)
                assert _attempts(inbox.got) == list(range(6))
                tg.cancel_scope.cancel()

    async def test_pending_bound(self) -> None:
        """At most ``PENDING_CALLS`` calls wait per endpoint; the oldest are dropped and counted."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            extra = 5
            before = h.dropped_pending()
            for i in range(PENDING_CALLS + extra):
                await coordinator.call("ep-flood", _mark(i), epoch=1)
            assert h.dropped_pending() - before == extra
            async with anyio.create_task_group() as tg:
                inbox = await _inbox(h, tg, "ep-flood")
                await _until(lambda: len(inbox.got) >= PENDING_CALLS, 10, "the waiting calls")
                await anyio.sleep(QUIET_S)
                assert _attempts(inbox.got) == list(range(extra, PENDING_CALLS + extra))
                tg.cancel_scope.cancel()

    async def test_stale_epoch_refused(self) -> None:
        """Calls of an older epoch than the newest one seen are refused and counted as
        ``stale-epoch``; calls of the newest epoch and newer pass."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            epochs = [2, 1, 2, 3, 2, 3, 1, 5]
            async with anyio.create_task_group() as tg:
                inbox = await _inbox(h, tg, "ep-e")
                await h.settle(connected=("ep-e",))
                for i, epoch in enumerate(epochs):
                    await coordinator.call("ep-e", _mark(i), epoch=epoch)
                await _until(lambda: 7 in _attempts(inbox.got), 10, "the last call")
                assert _attempts(inbox.got) == [0, 2, 3, 5, 7]
                assert inbox.link.drops["stale-epoch"] == 3
                assert inbox.link.epoch == 5
                tg.cancel_scope.cancel()

    async def test_duplicates_delivered(self) -> None:
        """A call or reply sent twice arrives twice (the cores deduplicate, not the channel)."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            call = msg.Prepare(info=_INFO)
            reply = msg.PrepareAccepted(attempt=_INFO.attempt, endpoint="ep-d")
            async with anyio.create_task_group() as tg:
                replies = await _collect(tg, coordinator)
                inbox = await _inbox(h, tg, "ep-d")
                await h.settle(connected=("ep-d",))
                for _ in range(2):
                    await coordinator.call("ep-d", call, epoch=3)
                    await inbox.link.notify(reply)
                await _until(lambda: len(inbox.got) >= 2, 10, "both calls")
                await _until(lambda: replies.got.count(reply) >= 2, 10, "both replies")
                await anyio.sleep(QUIET_S)
                assert inbox.got == [call, call]
                assert replies.got.count(reply) == 2
                tg.cancel_scope.cancel()

    async def test_reconnect_same_name(self) -> None:
        """After an endpoint's link closes, calls wait; a new link of the same name receives them
        and later calls, and closing the old link again changes nothing."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            async with anyio.create_task_group() as tg:
                old = await _inbox(h, tg, "ep-r")
                await h.settle(connected=("ep-r",))
                await coordinator.call("ep-r", _mark(0), epoch=1)
                await _until(lambda: len(old.got) >= 1, 10, "the first call")
                await old.link.aclose()
                await _until(lambda: old.ended, 10, "the old link's calls() to end")
                await h.settle(disconnected=("ep-r",))
                for i in (1, 2):
                    await coordinator.call("ep-r", _mark(i), epoch=1)
                new = await _inbox(h, tg, "ep-r")
                await _until(lambda: len(new.got) >= 2, 10, "the calls that waited")
                await old.link.aclose()
                await h.settle(connected=("ep-r",))
                await coordinator.call("ep-r", _mark(3), epoch=1)
                await _until(lambda: len(new.got) >= 3, 10, "a later call")
                await anyio.sleep(QUIET_S)
                assert _attempts(old.got) == [0]
                assert _attempts(new.got) == [1, 2, 3]
                tg.cancel_scope.cancel()

    async def test_aclose_ends_iteration(self) -> None:
        """``aclose`` ends ``calls()`` and ``replies()`` cleanly, also for a new iteration."""
        async with self.world() as h:
            coordinator = await h.coordinator()
            async with anyio.create_task_group() as tg:
                inbox = await _inbox(h, tg, "ep-c")
                replies = await _collect(tg, coordinator)
                await h.settle(connected=("ep-c",))
                await coordinator.call("ep-c", _mark(0), epoch=1)
                await _until(lambda: len(inbox.got) == 1, 10, "a call")
                await inbox.link.aclose()
                await coordinator.aclose()
                await _until(lambda: inbox.ended and replies.ended, 10, "both iterations to end")
                with anyio.fail_after(5):
                    assert [c async for c in inbox.link.calls()] == []
                    assert [r async for r in coordinator.replies()] == []
