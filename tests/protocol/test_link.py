"""Two cores wired through a fake link: an owner streams to a receiver, no world, no sockets."""

from __future__ import annotations

from collections import deque

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.lifecycle import OwnerPhase, ReceiverPhase
from dcr.protocol.owner import OwnerCore
from dcr.protocol.receiver import QueueConfig, ReceiverCore
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey

K0 = CommitRecord(version=0, candidate="g0")
INFO = AttemptInfo(
    attempt=1, candidate="g1", base=K0, mode=Mode.MIXED, sync=True, coordinator=1,
    owners=("o",), receivers=frozenset({"r"}),
)  # fmt: skip


class Link:
    """Delivers owner payloads to the receiver in reverse order; runs local work at once."""

    def __init__(self, payloads: int) -> None:
        self.owner = OwnerCore("o", baseline=K0)
        self.receiver = ReceiverCore("r", held=K0, queue=QueueConfig(groups=1, group_size=2))
        self.payloads = payloads
        self.wire: deque[ev.PayloadArrived] = deque()
        self.checks: dict[int, ev.PayloadArrived] = {}
        self.to_coordinator: list[ev.CoordinatorEvent] = []
        self.applied: list[int] = []

    def owner_event(self, e: ev.OwnerEvent) -> None:
        for c in self.owner.handle(e):
            match c:
                case cmd.BuildBucket(attempt=tau, payload_id=pid):
                    final = pid == self.payloads - 1
                    self.owner_event(ev.BucketBuilt(attempt=tau, payload_id=pid, final=final))
                case cmd.SendPayload(attempt=tau, payload_id=pid, final=final):
                    digest = f"o/{pid}".encode()
                    key = PayloadKey(attempt=tau, owner="o", payload_id=pid)
                    arrived = ev.PayloadArrived(delivery=pid, key=key, digest=digest, final=final)
                    self.wire.appendleft(arrived)
                    self.owner_event(ev.PayloadSent(attempt=tau, payload_id=pid))
                case cmd.Notify(message=reply):
                    self.to_coordinator.append(reply)

    def receiver_event(self, e: ev.ReceiverEvent) -> None:
        for c in self.receiver.handle(e):
            match c:
                case cmd.CheckPayload(delivery=delivery):
                    self.receiver_event(self.checks.pop(delivery))
                case cmd.Decode(key=key):
                    self.receiver_event(ev.PayloadDecoded(key=key))
                case cmd.Apply(attempt=tau, keys=keys):
                    self.applied += [k.payload_id for k in keys]
                    self.receiver_event(ev.PayloadsApplied(attempt=tau, keys=keys))
                case cmd.CloseGate(attempt=tau):
                    self.receiver_event(ev.RequestsDrained(attempt=tau))
                case cmd.Synchronize(attempt=tau):
                    self.receiver_event(ev.Synchronized(attempt=tau))
                case cmd.Notify(message=reply):
                    self.to_coordinator.append(reply)

    def pump(self) -> None:
        while self.wire:
            arrived = self.wire.popleft()
            self.checks[arrived.delivery] = arrived
            self.receiver_event(ev.PayloadReceived(delivery=arrived.delivery, key=arrived.key))


def test_owner_and_receiver_through_a_fake_link() -> None:
    link = Link(payloads=5)
    link.owner_event(msg.Prepare(info=INFO))
    link.receiver_event(msg.Prepare(info=INFO))
    link.receiver_event(msg.WaitForRequests(attempt=1, epoch=1))
    link.receiver_event(msg.OpenApply(attempt=1, epoch=1))
    link.owner_event(msg.StartStreaming(attempt=1))
    [done] = [e for e in link.to_coordinator if isinstance(e, msg.SendsDone)]
    assert done.payload_count == 5
    link.pump()  # arrives last-first; applied in declared order
    assert link.applied == [0, 1, 2, 3, 4]
    link.owner_event(msg.Flush(attempt=1, expected=(("o", 5),)))
    link.receiver_event(msg.Flush(attempt=1, expected=(("o", 5),)))
    [ack] = [e for e in link.to_coordinator if isinstance(e, msg.Acked)]
    assert ack.applied == (("o", 5),)
    assert link.owner.phase is OwnerPhase.SENT and link.receiver.phase is ReceiverPhase.ACKED
    kinds = [type(e).__name__ for e in link.to_coordinator]
    assert kinds.index("GateClosed") < kinds.index("Acked")
