"""Fault injection behind the real adapter interfaces, for tests and ``dcr demo --faults``.

A :class:`Faults` plan names what goes wrong in the *first* attempt of a transition (later
attempts -- the overwrite retries -- run clean, so a transition can always complete):
payloads dropped, duplicated, delivered out of order, corrupted or re-sent with conflicting
bytes; a receiver or an owner killed after some payloads; the compare-and-set reply lost; the
coordinator replaced mid-attempt.  :class:`FaultyTransport` and :class:`FaultyCommitStore`
wrap real adapters and misbehave exactly as planned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from dcr.adapters.commit.base import CommitState, CommitStore, Transaction
from dcr.adapters.transport.base import Transport, TransportWrapper
from dcr.errors import ConfigError
from dcr.protocol.types import CommitOutcome, CommitRecord, PayloadKey
from dcr.wire.payload import DecodeLimits, ValueLayout, decode_payload, encode_payload

__all__ = ["FaultLog", "FaultReport", "Faults", "FaultyCommitStore", "FaultyTransport"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """What goes wrong in the first attempt of a transition (all default to nothing).

    Counts of payloads (``*_after``) are ``>= 0``; ``0`` strikes as soon as the attempt's
    first payload is sent.
    """

    drop: int = 0
    """Payloads lost on the way (receivers never see them: the arrival check fails)."""
    duplicate: int = 0
    """Payloads delivered twice with identical bytes (receivers ignore the copy)."""
    reorder: bool = False
    """Deliver each owner's payloads in reverse order of sending (within what is held back)."""
    corrupt: int = 0
    """Payloads with one byte flipped (the digest check rejects them)."""
    conflicting: int = 0
    """Payloads re-sent under the same id with other, valid bytes (fails the attempt)."""
    stall: int = 0
    """Sends that never return, as to a peer that died holding them (the attempt fails by
    its deadline; stopping it must cancel them)."""
    kill_receiver: str | None = None
    """Receiver killed once receivers applied ``kill_receiver_after`` payloads of the attempt;
    it restarts and rejoins by dense refit."""
    kill_receiver_after: int = 1
    kill_owner: str | None = None
    """Owner killed once it sent ``kill_owner_after`` payloads of the attempt; it restarts with
    its baseline reinitialized from the committed version."""
    kill_owner_after: int = 1
    lose_commit_reply: bool = False
    """The compare-and-set takes effect but its reply is lost (outcome unknown)."""
    late_commit: bool = False
    """The compare-and-set reaches the store only after its deadline (the store refuses it;
    the attempt is retried)."""
    failover: bool = False
    """The coordinator is replaced once receivers applied ``failover_after`` payloads: a new
    one takes over (paper App. B.2, failover)."""
    failover_after: int = 1
    old_keeps_running: bool = False
    """With ``failover``: the replaced coordinator does not die but keeps going; the control
    plane's epoch check makes it stand down."""

    def __post_init__(self) -> None:
        for name in (
            "drop",
            "duplicate",
            "corrupt",
            "conflicting",
            "stall",
            "kill_receiver_after",
            "kill_owner_after",
            "failover_after",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"Faults.{name} must be >= 0")

    @property
    def any(self) -> bool:
        return self != Faults()


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultReport:
    """What the injected faults of one transition actually did."""

    dropped: int = 0
    duplicated: int = 0
    corrupted: int = 0
    conflicting: int = 0
    stalled: int = 0
    reordered: int = 0
    lost_commit_replies: int = 0
    late_commits: int = 0
    failovers: int = 0
    killed: tuple[str, ...] = ()
    """Endpoints whose process was killed, in order."""
    restarted: tuple[str, ...] = ()
    """Endpoints restarted afterwards (receivers rejoin by dense refit)."""
    replaced_outcome: str | None = None
    """With ``old_keeps_running``: how the replaced coordinator's run ended."""

    @property
    def any(self) -> bool:
        return self != FaultReport()


@dataclass(slots=True)
class FaultLog:
    """What the injected faults did, as it happens (the payloads they struck)."""

    dropped: list[PayloadKey] = field(default_factory=list)
    duplicated: list[PayloadKey] = field(default_factory=list)
    corrupted: list[PayloadKey] = field(default_factory=list)
    conflicting: list[PayloadKey] = field(default_factory=list)
    stalled: list[PayloadKey] = field(default_factory=list)
    reordered: int = 0
    killed: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    lost_commit_replies: int = 0
    late_commits: int = 0
    failovers: int = 0
    replaced_outcome: str | None = None

    def report(self) -> FaultReport:
        return FaultReport(
            dropped=len(self.dropped),
            duplicated=len(self.duplicated),
            corrupted=len(self.corrupted),
            conflicting=len(self.conflicting),
            stalled=len(self.stalled),
            reordered=self.reordered,
            lost_commit_replies=self.lost_commit_replies,
            late_commits=self.late_commits,
            failovers=self.failovers,
            killed=tuple(self.killed),
            restarted=tuple(self.restarted),
            replaced_outcome=self.replaced_outcome,
        )


class FaultyTransport(TransportWrapper):
    """Wraps a transport; misbehaves on the first attempt it sees after :meth:`arm`.

    ``seal_key`` is the fleet's payload key (:func:`dcr.wire.seal.seal_keys`) when its
    payloads are sealed: a conflicting re-send is sealed with it too, as an owner would."""

    def __init__(self, inner: Transport, *, seal_key: bytes | None = None) -> None:
        super().__init__(inner)
        self.seal_key = seal_key
        self.faults = Faults()
        self.log = FaultLog()
        self._target: int | None = None
        self._armed = False
        self._held: dict[str, list[tuple[PayloadKey, bytes]]] = {}

    def arm(self, faults: Faults, log: FaultLog) -> None:
        """Apply ``faults`` to the next attempt that sends a payload."""
        self.faults, self.log = faults, log
        self._armed = faults.any
        self._target = None
        self._held.clear()

    def _faulty(self, attempt: int) -> bool:
        if self._armed and self._target is None:
            self._target = attempt
        return self._armed and attempt == self._target

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        if not self._faulty(key.attempt):
            await self.inner.send(key, data, to=to)
            return
        f, log = self.faults, self.log
        if len(log.dropped) < f.drop:
            log.dropped.append(key)
            return
        if len(log.stalled) < f.stall:
            log.stalled.append(key)
            await anyio.sleep_forever()
        if len(log.corrupted) < f.corrupt and len(data) > 80:
            log.corrupted.append(key)
            broken = bytearray(data)
            broken[len(broken) // 2] ^= 0x20
            await self.inner.send(key, bytes(broken))
            return
        if f.reorder and not _final(data):
            self._held.setdefault(key.owner, []).append((key, data))
            return
        await self.inner.send(key, data)
        for held_key, held in reversed(self._held.pop(key.owner, [])):
            self.log.reordered += 1
            await self.inner.send(held_key, held)
        if len(log.duplicated) < f.duplicate:
            log.duplicated.append(key)
            await self.inner.send(key, data)
        if len(log.conflicting) < f.conflicting:
            other = _reencoded(data, self.seal_key)
            if other is not None:
                log.conflicting.append(key)
                await self.inner.send(key, other)

    async def stop_and_wait(self, attempt: int) -> None:
        # Payloads held back for reordering are in flight: stopping the attempt drops them.
        for owner, held in list(self._held.items()):
            self._held[owner] = [(k, d) for k, d in held if k.attempt != attempt]
        await self.inner.stop_and_wait(attempt)


_OWN = DecodeLimits(max_expansion=1 << 40)


def _final(data: bytes) -> bool:
    return len(data) > 7 and bool(data[6] & 1)


def _reencoded(data: bytes, seal_key: bytes | None) -> bytes | None:
    """The same entries in other bytes (a higher zstd level, sealed as the original), or
    ``None`` if identical."""
    # the owners' own payloads: decoded without a catalog however well they compress
    payload = decode_payload(data, seal_key=seal_key, limits=_OWN)
    layout = payload.header.layout or ValueLayout.BYTEPLANE
    other = encode_payload(
        payload.header, payload.items, level=19, layout=layout, seal_key=seal_key
    )
    return other if other != data else None


class FaultyCommitStore(CommitStore):
    """Wraps a commit store; after :meth:`arm` the first compare-and-set arrives late or loses
    its reply, as planned."""

    def __init__(self, inner: CommitStore) -> None:
        super().__init__(clock=inner.clock, poll_s=inner.poll_s)
        self.inner = inner
        self._lose = False
        self._late = False
        self.log = FaultLog()

    def arm(self, faults: Faults, log: FaultLog) -> None:
        self._lose = faults.lose_commit_reply
        self._late = faults.late_commit
        self.log = log

    async def _transact(self, fn: Transaction) -> CommitState:
        return await self.inner._transact(fn)

    async def compare_and_set(
        self,
        *,
        epoch: int,
        attempt: int,
        expected: CommitRecord,
        new: CommitRecord,
        deadline: float,
    ) -> CommitOutcome:
        if self._late:
            self._late = False
            self.log.late_commits += 1
            await anyio.sleep(max(0.0, deadline - self.clock()) + 0.01)
        outcome = await self.inner.compare_and_set(
            epoch=epoch, attempt=attempt, expected=expected, new=new, deadline=deadline
        )
        if self._lose:
            self._lose = False
            self.log.lost_commit_replies += 1
            return CommitOutcome.UNKNOWN
        return outcome

    async def close(self) -> None:
        await self.inner.close()
