"""A receiver's ingestion of one attempt or dense-refit job: the bounded queue, declared order.

An :class:`Ingest` keys every delivery by ``(owner, payload id)``: it deduplicates them, keeps
the declared order ``(payload id, owner)`` in which payloads are applied (paper App. B.1),
schedules decoding into the bounded queue (:class:`QueueConfig`, paper App. C) and picks the
next group to apply.  It also holds what the arrival check compares: what arrived against
what the owners declared they sent.  The receiver core (:mod:`dcr.protocol.receiver`) feeds
it events and decides what failures, acknowledgements and stops follow.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol.proof import Proof
from dcr.protocol.types import AttemptInfo, PayloadKey

__all__ = ["Ingest", "QueueConfig", "missing_message"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueConfig:
    """Bound on decoded payloads held for application (paper App. C: 32 groups of 8 + 1)."""

    groups: int = 32
    group_size: int = 8
    """Payloads applied by one ``Apply`` command (one assembly group)."""

    def __post_init__(self) -> None:
        if self.groups < 1 or self.group_size < 1:
            raise ConfigError(f"queue needs at least one group of one payload, got {self}")

    @property
    def capacity(self) -> int:
        """Decoded payloads held at most: the full groups plus the group being assembled."""
        return (self.groups + 1) * self.group_size


@dataclass(slots=True)
class Ingest:
    """Per-attempt (or per dense-refit job) ingestion state, keyed by ``(owner, payload id)``."""

    info: AttemptInfo
    dense: bool = False
    proof: Proof | None = None
    """This receiver's proof of the base version, sent with its acceptance."""
    seen: dict[tuple[str, int], bytes] = field(default_factory=dict)
    received: set[PayloadKey] = field(default_factory=set)
    """Keys of every delivery the transport handed over, checked or not (arrival check)."""
    checking: set[int] = field(default_factory=set)
    """Deliveries whose reception checks are running."""
    highest: int = -1
    """Highest payload id seen or declared; nothing beyond it can be applied yet."""
    finals: dict[str, int] = field(default_factory=dict)
    staged: set[PayloadKey] = field(default_factory=set)
    decoding: set[PayloadKey] = field(default_factory=set)
    decoded: set[PayloadKey] = field(default_factory=set)
    kept: set[PayloadKey] = field(default_factory=set)
    """Asynchronous RL: staged payloads whose reception check's decode the engine keeps (a
    slot of the bounded queue each), so that the gated window decodes nothing."""
    applying: tuple[PayloadKey, ...] = ()
    cursor: int = 0
    applied: dict[str, int] = field(default_factory=dict)
    all_checked: bool = True
    apply_open: bool = False
    expected: dict[str, int] | None = None
    arrival_armed: bool = False
    staged_reported: bool = False
    synchronizing: bool = False
    paused: bool = False
    want: PayloadKey | None = None
    """While paused: the one payload ingestion still lets through."""
    stop_pending: bool = False
    failed: bool = False

    waiting: list[tuple[int, PayloadKey]] = field(default_factory=list)
    """Synchronous RL: staged payloads by declared position (a heap), for decoding."""
    rank: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rank = {o: i for i, o in enumerate(self.info.owners)}

    @property
    def attempt(self) -> int:
        return self.info.attempt

    def position(self, key: PayloadKey) -> int:
        """Index of ``key`` in the declared order ``(payload id, owner)`` (App. B.1)."""
        return key.payload_id * len(self.info.owners) + self.rank[key.owner]

    def order(self) -> Iterator[tuple[int, PayloadKey]]:
        """Keys in declared order from the cursor, skipping owners known to be finished."""
        owners = self.info.owners
        pos = self.cursor
        while pos // len(owners) <= self.highest:
            pid, i = divmod(pos, len(owners))
            final = self.finals.get(owners[i])
            if final is None or pid <= final:
                yield pos, PayloadKey(attempt=self.info.attempt, owner=owners[i], payload_id=pid)
            pos += 1

    def next_key(self) -> PayloadKey | None:
        """The payload to apply next, or ``None`` if every owner's final one is applied."""
        for _, key in self.order():
            return key
        owners = self.info.owners
        if all(o in self.finals for o in owners):
            return None
        # Some owner's final payload is unknown: its next id is what comes next.
        pid, i = divmod(self.cursor, len(owners))
        while owners[i] in self.finals and pid > self.finals[owners[i]]:
            pid, i = divmod(pid * len(owners) + i + 1, len(owners))
        return PayloadKey(attempt=self.info.attempt, owner=owners[i], payload_id=pid)

    @property
    def used(self) -> int:
        return len(self.decoding) + len(self.decoded) + len(self.kept)

    def keeps(self, capacity: int) -> bool:
        """Whether a payload staged now keeps its decoded form: always in synchronous RL
        (it is decoded next anyway); in asynchronous RL while the bounded queue has room but
        for one slot, which the declared order's next payload can always take."""
        return self.info.sync or self.used < capacity - 1

    def full(self, capacity: int) -> bool:
        """Payloads being checked, staged and decoded fill the bounded queue."""
        return len(self.checking) + len(self.staged) + self.used >= capacity

    def complete(self) -> bool:
        """Every owner's final payload is known and every payload up to it was applied."""
        owners = self.info.owners
        return all(o in self.finals for o in owners) and all(
            self.applied.get(o, 0) == self.finals[o] + 1 for o in owners
        )

    def counts(self) -> tuple[tuple[str, int], ...]:
        return tuple((o, self.applied.get(o, 0)) for o in self.info.owners)

    def arrived(self) -> tuple[tuple[str, int], ...] | None:
        """``(owner, count)`` when every payload up to each owner's final one arrived.

        Ingestion refuses ids beyond an owner's final one, so counting suffices.
        """
        owners = self.info.owners
        if not all(o in self.finals for o in owners):
            return None
        if len(self.seen) != sum(self.finals[o] + 1 for o in owners):
            return None
        return tuple((o, self.finals[o] + 1) for o in owners)

    def missing(self) -> list[PayloadKey]:
        """Declared payloads (``expected``) the transport never handed over."""
        if self.expected is None:
            return []
        return [
            key
            for o in self.info.owners
            for pid in range(self.expected.get(o, 0))
            if (key := PayloadKey(attempt=self.info.attempt, owner=o, payload_id=pid))
            not in self.received
        ]

    # -- deduplication and declared order (App. B.1) ---------------------------------------

    def order_problem(self, key: PayloadKey, final: bool) -> str | None:
        """Why a checked payload breaks its owner's declared order, or ``None``."""
        last = self.finals.get(key.owner)
        if last is not None and key.payload_id > last:
            return f"payload {key.owner}/{key.payload_id} follows final payload {last}"
        if final and any(o == key.owner and pid > key.payload_id for o, pid in self.seen):
            return f"final payload {key.owner}/{key.payload_id} precedes a later one"
        if self.expected is not None and key.payload_id >= self.expected.get(key.owner, 0):
            return f"payload {key.owner}/{key.payload_id} was not declared by its owner"
        return None

    def record(self, key: PayloadKey, digest: bytes, final: bool) -> None:
        """A checked payload is new and in order: remember it (deduplication, finals)."""
        self.seen[(key.owner, key.payload_id)] = digest
        self.highest = max(self.highest, key.payload_id)
        if final:
            self.finals[key.owner] = key.payload_id

    def stage(self, key: PayloadKey, *, kept: bool = False) -> None:
        """Stage a recorded payload for decoding (``kept``: its decoded form is held)."""
        self.staged.add(key)
        if kept and not self.info.sync:
            self.kept.add(key)
        if self.info.sync:
            heapq.heappush(self.waiting, (self.position(key), key))

    # -- the bounded queue and declared-order application ----------------------------------

    def decode(self, key: PayloadKey, out: list[cmd.ReceiverCommand]) -> None:
        self.staged.discard(key)
        self.kept.discard(key)
        self.decoding.add(key)
        out.append(cmd.Decode(key=key))

    def fill(self, capacity: int, nxt: PayloadKey | None, out: list[cmd.ReceiverCommand]) -> None:
        """Decode staged payloads into free queue slots (``nxt``: the next in declared order)."""
        if self.info.sync:
            # Decode on arrival; one slot stays reserved for the next payload in declared
            # order so that later payloads cannot fill the queue first (App. B.1).
            if nxt is not None and nxt in self.staged and self.used < capacity:
                self.decode(nxt, out)
            while self.waiting and self.used < capacity - 1:
                _, key = heapq.heappop(self.waiting)
                if key in self.staged:
                    self.decode(key, out)
        elif self.apply_open:
            # Asynchronous RL: staged payloads are decoded in declared order after open_apply
            # (one whose decode was kept at arrival holds its slot already: nothing to do).
            for _, key in self.order():
                present = key in self.staged or key in self.decoding or key in self.decoded
                if not present or (key not in self.kept and self.used >= capacity):
                    break
                if key in self.staged:
                    self.decode(key, out)

    def next_group(self, group_size: int) -> tuple[PayloadKey, ...]:
        """The decoded payloads to apply next: a run in declared order from the cursor."""
        group: list[PayloadKey] = []
        for _, key in self.order():
            if key not in self.decoded or len(group) == group_size:
                break
            group.append(key)
        return tuple(group)

    def applied_group(self, keys: tuple[PayloadKey, ...], post_apply_checked: bool) -> None:
        """The group ``keys`` was applied: advance the cursor past it."""
        self.cursor = self.position(keys[-1]) + 1
        for key in keys:
            self.decoded.discard(key)
            self.applied[key.owner] = self.applied.get(key.owner, 0) + 1
        self.all_checked = self.all_checked and post_apply_checked

    def pause_if_full(self, capacity: int, nxt: PayloadKey | None) -> None:
        """Pause ingestion while the queue is full, letting only the next payload through."""
        if self.full(capacity):
            in_hand = (self.staged, self.decoding, self.decoded, self.applying)
            missing = nxt is not None and all(nxt not in held for held in in_hand)
            self.paused, self.want = True, nxt if missing else None
        else:
            self.paused, self.want = False, None

    def clear(self) -> None:
        """Cleanup: nothing more of the attempt is staged, decoded or checked."""
        self.staged.clear()
        self.waiting.clear()
        self.decoding.clear()
        self.decoded.clear()
        self.kept.clear()
        self.checking.clear()
        self.paused, self.want = False, None

    # -- the arrival check (App. B.1) ------------------------------------------------------

    def declare(self, expected: dict[str, int]) -> str | None:
        """Take the owners' declared sent lists (``owner -> count``); why what arrived
        contradicts them, or ``None``."""
        self.expected = expected
        for o in self.info.owners:
            count = expected.get(o, 0)
            if self.finals.get(o, count - 1) != count - 1 or any(
                owner == o and pid >= count for owner, pid in self.seen
            ):
                return f"owner {o} declared {count} payloads"
            self.finals[o] = count - 1
            self.highest = max(self.highest, count - 1)
        return None


def missing_message(missing: list[PayloadKey]) -> str:
    """Why the arrival check fails: declared payloads never arrived."""
    first = missing[0]
    return (
        f"{len(missing)} declared payloads never arrived (first {first.owner}/{first.payload_id})"
    )
