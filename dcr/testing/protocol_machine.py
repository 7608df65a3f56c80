"""A hypothesis state machine that drives the real protocol cores through a faulty world.

Rules deliver, duplicate, drop, reorder and corrupt messages, fire timers, crash receivers,
owners and coordinators, let a replacement coordinator take over (and win the commit race),
lose commit replies and abort.  After every step the world is projected into the
specification state and checked against the model's invariants
(:data:`dcr.testing.spec.invariants.INVARIANTS`).

Use it as ``TestCase = ProtocolMachine.TestCase`` with the settings you need.
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.lifecycle import TransitionPhase
from dcr.protocol.receiver import QueueConfig
from dcr.testing.protocol_world import World
from dcr.testing.spec.invariants import violations
from dcr.testing.world_messages import Kind

__all__ = ["ProtocolMachine"]

_ANY = st.integers(min_value=0, max_value=1 << 16)
_RARE = st.integers(min_value=0, max_value=7)
"""Rules that end the transition act only on a roll of 0, so that most runs go further."""


class ProtocolMachine(RuleBasedStateMachine):
    """Real coordinator, owner and receiver cores wired through :class:`World`."""

    steps: ClassVar[int] = 0
    """Rules executed by all runs so far (reported by the tests)."""
    runs: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.budget = {
            "drop": 3,
            "duplicate": 3,
            "corrupt": 1,
            "expire": 4,
            "crash_receiver": 1,
            "crash_owner": 1,
            "take_over": 1,
            "lose_reply": 1,
            "abort": 1,
        }

    @initialize(
        sync=st.booleans(),
        owners=st.integers(min_value=1, max_value=2),
        receivers=st.integers(min_value=2, max_value=3),
        payloads=st.integers(min_value=1, max_value=3),
        queue=st.sampled_from([(1, 1), (1, 2), (32, 8)]),
    )
    def start(
        self, sync: bool, owners: int, receivers: int, payloads: int, queue: tuple[int, int]
    ) -> None:
        type(self).runs += 1
        self.world = World(
            owners=[f"o{i}" for i in range(owners)],
            receivers=[f"r{i}" for i in range(receivers)],
            payloads=payloads,
            sync=sync,
            queue=QueueConfig(groups=queue[0], group_size=queue[1]),
        )
        self.world.start()

    def _spend(self, fault: str) -> bool:
        if self.budget[fault] <= 0:
            return False
        self.budget[fault] -= 1
        return True

    def _count(self) -> None:
        type(self).steps += 1

    # -- delivery: three rules so that progress outweighs faults ----------------------

    @precondition(lambda self: bool(self.world.messages))
    @rule()
    def deliver_oldest(self) -> None:
        self._count()
        self.world.deliver(0)

    @precondition(lambda self: bool(self.world.messages))
    @rule()
    def deliver_newest(self) -> None:
        self._count()
        self.world.deliver(len(self.world.messages) - 1)

    @precondition(lambda self: bool(self.world.messages))
    @rule(i=_ANY)
    def deliver_any(self, i: int) -> None:
        self._count()
        self.world.deliver(i % len(self.world.messages))

    # -- message faults ---------------------------------------------------------------

    @rule(i=_ANY)
    def duplicate(self, i: int) -> None:
        picks = self.world.indices(lambda m: m.kind in (Kind.PAYLOAD, Kind.CALL))
        if picks and self._spend("duplicate"):
            self._count()
            self.world.duplicate(picks[i % len(picks)])

    @rule(i=_ANY)
    def drop(self, i: int) -> None:
        picks = self.world.indices(lambda m: m.droppable)
        if picks and self._spend("drop"):
            self._count()
            self.world.drop(picks[i % len(picks)])

    @rule(i=_ANY, conflicting=st.booleans())
    def corrupt_payload(self, i: int, conflicting: bool) -> None:
        picks = self.world.indices(lambda m: m.kind is Kind.PAYLOAD)
        if picks and self._spend("corrupt"):
            self._count()
            self.world.corrupt(picks[i % len(picks)], conflicting=conflicting)

    @rule(i=_ANY)
    def expire_deadline(self, i: int) -> None:
        if self.world.timers and self._spend("expire"):
            self._count()
            self.world.expire(i % len(self.world.timers))

    @rule(i=_ANY)
    def expire_arrival_check(self, i: int) -> None:
        """A receiver's arrival grace passes (payloads still missing fail the attempt)."""
        if self.world.arrival_timers:
            self._count()
            self.world.expire_arrival(i % len(self.world.arrival_timers))

    @rule(i=_ANY)
    def lose_commit_reply(self, i: int) -> None:
        picks = self.world.indices(
            lambda m: m.kind is Kind.STORE_REPLY and isinstance(m.event, ev.CommitReplied)
        )
        if picks and self._spend("lose_reply"):
            self._count()
            self.world.lose_commit_reply(picks[i % len(picks)])

    @rule()
    def rival_commit(self) -> None:
        """The replacement coordinator's compare-and-set reaches the control plane first."""
        cas = self.world.indices(
            lambda m: m.kind is Kind.STORE and isinstance(m.event, cmd.CompareAndSet)
        )
        epochs = {self.world.messages[i].epoch for i in cas}
        if len(epochs) > 1:
            self._count()
            newest = max(cas, key=lambda i: self.world.messages[i].epoch)
            self.world.deliver(newest)

    # -- process faults ---------------------------------------------------------------

    @rule(i=_ANY)
    def crash_receiver(self, i: int) -> None:
        names = self.world.receiver_names
        if self._spend("crash_receiver"):
            self._count()
            self.world.crash_receiver(names[i % len(names)])

    @rule(i=_ANY)
    def dense_refit(self, i: int) -> None:
        names = [r for r in self.world.receiver_names if self.world.can_dense_refit(r)]
        if names:
            self._count()
            self.world.dense_refit(names[i % len(names)])

    @rule(i=_ANY, roll=_RARE)
    def crash_owner_and_abort(self, i: int, roll: int) -> None:
        """An owner loses its state; the operator aborts the transition (App. B.2)."""
        names = self.world.owner_names
        if roll == 0 and self._spend("crash_owner"):
            self._count()
            self.world.crash_owner(names[i % len(names)])
            self.world.operator_abort("owner lost its state")

    @rule(kill_old=st.booleans())
    def take_over(self, kill_old: bool) -> None:
        active = self.world.coordinators.get(self.world.epoch)
        if active is None or active.outcome is not None or active.phase is TransitionPhase.IDLE:
            return
        if self._spend("take_over"):
            self._count()
            self.world.take_over(kill_old=kill_old)

    @rule(roll=_RARE)
    def operator_abort(self, roll: int) -> None:
        if roll == 0 and self._spend("abort"):
            self._count()
            self.world.operator_abort()

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def specification_invariants_hold(self) -> None:
        state = self.world.project()
        found = violations(state)
        assert not found, f"{found}\nmessages in flight: {len(self.world.messages)}"
        assert not self.world.problems, self.world.problems

    def teardown(self) -> None:
        """Run on without faults (messages, then timers, then dense refits); check the
        invariants on the way and that every live coordinator ends."""
        for _ in range(3000):
            if self.world.messages:
                self.world.deliver(0)
            elif self.world.arrival_timers:
                self.world.expire_arrival(0)
            elif self.world.timers:
                self.world.expire(0)
            elif refit := [r for r in self.world.receiver_names if self.world.can_dense_refit(r)]:
                self.world.dense_refit(refit[0])
            else:
                break
            self.specification_invariants_hold()
        # Liveness once the faults stop: every coordinator that still runs finishes.
        for epoch, core in self.world.coordinators.items():
            if epoch in self.world.alive_coordinators:
                assert core.outcome is not None, (
                    f"coordinator {epoch} stuck in {core.phase.value}/{core.attempt_phase}"
                )
