"""A dense job's payloads may overtake its call: the receiver core holds them, bounded by the
transport's window, and lets them through once the job starts (never drops them unread)."""

from __future__ import annotations

from collections.abc import Sequence

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.ingest import QueueConfig
from dcr.protocol.lifecycle import ReceiverPhase
from dcr.protocol.receiver import ReceiverCore
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey

K0 = CommitRecord(version=0, candidate="g0")
OWNERS = ("o0", "o1", "o2", "o3")
ONE = QueueConfig(groups=1, group_size=1)


def dense(job: int, owners: tuple[str, ...] = OWNERS) -> msg.DenseRefit:
    return msg.DenseRefit(job=job, record=K0, owners=owners, receivers=frozenset({"r"}))


class Receiver:
    """Plays the receiver engine and the transport's credit: numbers deliveries, completes
    every check, decode, apply and synchronization the core asks for, and records which
    deliveries were acknowledged, discarded or applied."""

    def __init__(self, core: ReceiverCore) -> None:
        self.core = core
        self.keys: dict[int, PayloadKey] = {}
        self.unacked: set[int] = set()
        self.discarded: dict[int, str] = {}
        self.applied: list[PayloadKey] = []
        self.notified: list[object] = []
        self.finals: set[int] = set()

    def deliver(
        self, job: int, owner: str, pid: int, final: bool = False, *, addressed: bool = True
    ) -> None:
        d = len(self.keys) + 1
        k = PayloadKey(attempt=job, owner=owner, payload_id=pid)
        self.keys[d] = k
        self.unacked.add(d)
        if final:
            self.finals.add(d)
        self.handle(ev.PayloadReceived(delivery=d, key=k, addressed=addressed))

    def handle(self, event: ev.ReceiverEvent) -> None:
        self.run(self.core.handle(event))

    def run(self, out: Sequence[cmd.ReceiverCommand]) -> None:
        for c in out:
            match c:
                case cmd.CheckPayload(delivery=d):
                    self.unacked.discard(d)
                    k = self.keys[d]
                    final = d in self.finals
                    digest = f"{k.owner}{k.payload_id}".encode()
                    self.handle(ev.PayloadArrived(delivery=d, key=k, digest=digest, final=final))
                case cmd.Acknowledge(delivery=d):
                    self.unacked.discard(d)
                case cmd.Discard(delivery=d, reason=reason):
                    self.unacked.discard(d)
                    self.discarded[d] = reason
                case cmd.Decode(key=k):
                    self.handle(ev.PayloadDecoded(key=k))
                case cmd.Apply(attempt=tau, keys=keys):
                    self.applied += keys
                    self.handle(ev.PayloadsApplied(attempt=tau, keys=keys))
                case cmd.Synchronize(attempt=tau):
                    self.handle(ev.Synchronized(attempt=tau))
                case cmd.Notify(message=m):
                    self.notified.append(m)


def test_dense_payloads_that_overtake_the_call_are_held_and_applied_once_it_arrives() -> None:
    """A receiver that has just started takes the first payloads of its dense job before the
    job's call reaches it: they are held unread, then applied in declared order."""
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=8))
    for owner in ("o0", "o1", "o2"):
        r.deliver(7, owner, 0)
    assert r.discarded == {} and r.applied == [] and r.core.parked == 3
    assert r.unacked == {1, 2, 3}  # unread and unacknowledged: within the window
    r.handle(dense(7))
    r.deliver(7, "o3", 0)
    for owner in OWNERS:
        r.deliver(7, owner, 1, final=True)
    assert r.discarded == {}
    assert [(k.owner, k.payload_id) for k in r.applied] == [(o, p) for p in (0, 1) for o in OWNERS]
    [ready] = [m for m in r.notified if isinstance(m, msg.ReceiverReady)]
    assert ready.record == K0 and ready.job == 7 and r.core.held == K0
    assert r.core.parked == 0 and not r.unacked


def test_early_deliveries_are_held_at_most_a_window_and_leave_one_credit_free() -> None:
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=3))
    for pid in range(5):
        r.deliver(4, "o0", pid)
    # Three held (the oldest acknowledged unread, so one credit stays free); beyond the
    # window they are discarded, which acknowledges them too.
    assert r.core.parked == 3 and r.unacked == {2, 3}
    assert r.discarded == {4: "early-overflow", 5: "early-overflow"}


def test_a_late_payload_of_an_ended_or_replaced_job_is_dropped_not_held() -> None:
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=8))
    r.handle(dense(5, owners=("o0",)))
    r.deliver(5, "o0", 0, final=True)
    assert r.core.held == K0 and r.core.dense_job is None
    r.deliver(5, "o0", 0, final=True)  # a duplicate of the ended job
    assert r.discarded == {2: "not the active attempt"} and r.core.parked == 0
    r.handle(dense(9, owners=("o0",)))  # its payloads come later; an older job's never
    r.deliver(8, "o0", 0)
    assert r.discarded[3] == "not the active attempt" and r.core.parked == 0


def test_a_starting_job_discards_held_deliveries_of_other_jobs() -> None:
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=8))
    r.deliver(10, "o0", 0)
    r.deliver(11, "o0", 0, final=True)
    r.handle(dense(11, owners=("o0",)))
    assert r.discarded == {1: "obsolete"}
    assert [k.attempt for k in r.applied] == [11] and r.core.held == K0


def test_a_payload_sent_to_every_subscriber_is_never_held_for_a_job_yet_to_come() -> None:
    """An attempt's payloads go to every subscribed receiver, members of the attempt or not
    (a receiver that restarted mid-attempt, joining): they are dropped at once, so that
    they never hold the transport's credit (the owners' sends would never complete)."""
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=8))
    for pid in range(3):
        r.deliver(6, "o0", pid, addressed=False)
    assert r.core.parked == 0 and not r.unacked
    assert set(r.discarded.values()) == {"not the active attempt"}


def test_a_prepare_discards_held_deliveries_of_other_attempts() -> None:
    core = ReceiverCore("r", held=K0, queue=ONE, window=8)
    assert core.phase is ReceiverPhase.READY
    r = Receiver(core)
    r.deliver(3, "o0", 0)  # a job this ready receiver never started
    info = AttemptInfo(
        attempt=4, candidate="g4", base=K0, mode=Mode.MIXED, sync=True, coordinator=1,
        owners=("o0",), receivers=frozenset({"r"}),
    )  # fmt: skip
    r.handle(msg.Prepare(info=info))
    assert r.discarded == {1: "obsolete"} and r.core.parked == 0
    assert any(isinstance(m, msg.PrepareAccepted) for m in r.notified)


def test_a_dense_payload_whose_predecessor_never_came_fails_the_job_at_once() -> None:
    """An owner sends its dense payloads one at a time and transports keep its order: o0/1
    arriving without o0/0 means o0/0 was lost.  The job fails at once ("missing") instead of
    holding o0/1 unread until the coordinator gives up on the receiver."""
    r = Receiver(ReceiverCore("r", held=None, queue=ONE, window=8))
    r.handle(dense(3, owners=("o0", "o1")))
    r.deliver(3, "o1", 0)
    r.deliver(3, "o0", 1)
    [failure] = [m for m in r.notified if isinstance(m, msg.AttemptFailed)]
    assert (failure.attempt, failure.check) == (3, "missing") and "o0/0" in failure.message
    assert r.core.dense_job is None and r.core.parked == 0 and not r.unacked
