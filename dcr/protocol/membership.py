"""Membership between transitions (paper App. B.2, joining receivers and failover).

One transition's rules live in :mod:`dcr.protocol.coordinator`; this core decides everything
*between* transitions, for a coordinator that runs many:

* which receivers a transition requires -- those whose last report says they hold the base
  record exactly -- and whether its first prepare fingerprints them completely (a receiver
  seen for the first time, restarted, or restored since a complete fingerprint checked it);
* when a transition starts: every owner staged the next version on the committed record, and
  every receiver holds it, or ``join_wait_s`` passed since the owners staged (the joiners are
  then left to their dense refit); or an attempt a replaced coordinator registered is
  unfinished (it is taken over);
* when a receiver that does not hold the committed record is restored by a dense-refit job,
  under which job id (:class:`~dcr.protocol.types.EpochIds`), when the job is checked for
  arrival, retried (failed, or past ``dense_timeout_s``) or released, and when the restored
  receiver's gate reopens;
* that an endpoint reappearing with a new incarnation was restarted: its old process is gone
  (``Retire``), and it is fingerprinted again before it takes part;
* that a receiver which departed (:class:`~dcr.protocol.events.Departed`: gone past the
  coordinator's bound, or its node lost) is no longer required nor waited for: its status is
  forgotten and the running transition goes on without it (``Depart``); when it reports
  again it rejoins as a receiver seen for the first time;
* that after a transition the next one waits (bounded by ``settle_s``) until the receivers
  that took part report the committed record.

It is sans-IO like the transition cores: :meth:`MembershipCore.handle` takes an event --
an endpoint's status report, a restored receiver, a dense job's sends done or failed, the
end of a transition, a request to restore receivers, or a :class:`Tick` carrying the time and
the commit record -- and returns commands.  Time arrives only with :class:`Tick`.  The fleet
coordinator (:mod:`dcr.fleet.coordinator`) and the in-process cluster
(:mod:`dcr.engine.cluster`) execute it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dcr.protocol import messages as msg
from dcr.protocol.events import Departed
from dcr.protocol.types import AttemptInfo, CommitRecord, EpochIds

__all__ = [
    "CheckArrival",
    "Depart",
    "DenseAsked",
    "MembershipCommand",
    "MembershipConfig",
    "MembershipCore",
    "MembershipEvent",
    "ReleaseJob",
    "ReopenGate",
    "Retire",
    "RunTransition",
    "Say",
    "StartDense",
    "Tick",
    "TransitionDone",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipConfig:
    """The fleet's members and the deadlines of membership."""

    owners: tuple[str, ...]
    receivers: tuple[str, ...]
    join_wait_s: float = 0.0
    """How long a staged version waits for joining receivers before it goes without them."""
    dense_timeout_s: float = 600.0
    """A dense-refit job that has not restored its receiver by then is sent again."""
    retry_s: float = 1.0
    """A dense job that failed is sent again this soon."""
    settle_s: float = 300.0
    """How long, after a transition, the next one waits for its members to report."""
    silent_s: float = 30.0
    """How long before the coordinator says which members never reported (and again every
    as long while they stay silent)."""
    fingerprint_on_join: bool = True
    """Whether the first prepare a receiver takes part in after it joined fingerprints it."""


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """The time, and the commit store's state: its ``record`` and the last attempt it
    registered (``attempt``; ``None`` when none or unreadable)."""

    now: float
    record: CommitRecord
    attempt: AttemptInfo | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionDone:
    """The transition :class:`RunTransition` started ended.

    ``record``: the commit record after it; ``epoch``: the epoch its coordinator ended in (a
    run claims a newer one when it takes over); ``replaced``: another coordinator replaced
    this one (nothing to settle: this process stands down); ``disproved``: the members the
    first (fingerprinting) prepare found not holding the base version, ``None`` when no
    prepare judged a proof.
    """

    record: CommitRecord
    epoch: int
    replaced: bool = False
    disproved: frozenset[str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseAsked:
    """A transition aborted and asks for these receivers to be restored to ``record``."""

    record: CommitRecord
    receivers: frozenset[str]


MembershipEvent = (
    Tick | TransitionDone | DenseAsked | Departed | msg.EndpointStatus | msg.ReceiverReady
    | msg.SendsDone | msg.AttemptFailed
)  # fmt: skip


# --- commands ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunTransition:
    """Run one transition from ``base`` requiring ``members``; ``fingerprint``: its first
    prepare fingerprints them completely; ``take_over``: the unfinished attempt of a replaced
    coordinator it resumes; ``not_waiting``: joining receivers it goes without."""

    base: CommitRecord
    members: tuple[str, ...]
    fingerprint: bool
    take_over: AttemptInfo | None = None
    not_waiting: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StartDense:
    """Ask the owners to send ``record`` to ``receiver`` as dense-refit job ``job``, which
    replaces the receiver's earlier job (if any)."""

    job: int
    receiver: str
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckArrival:
    """Every owner sent its last payload of ``job``: the receiver checks arrival."""

    job: int
    receiver: str
    expected: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseJob:
    """A dense job ended or was replaced: the transport releases what it holds of it."""

    job: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReopenGate:
    """``receiver`` restored ``record`` by job ``job``: it serves again at once."""

    job: int
    receiver: str
    record: CommitRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class Retire:
    """``endpoint`` restarted: tell the running transition its old process is gone."""

    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Depart:
    """``endpoint`` departed: tell the running transition (its core takes the receiver out
    and retires it from the current attempt: :class:`~dcr.protocol.events.Departed`)."""

    endpoint: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Say:
    """Something the operator should see (an event of the fleet's log)."""

    kind: str
    fields: dict[str, object] = field(default_factory=dict)


MembershipCommand = (
    RunTransition | StartDense | CheckArrival | ReleaseJob | ReopenGate | Retire | Depart | Say
)  # fmt: skip


# --- the core ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    """A dense refit of one receiver in flight."""

    job: int
    record: CommitRecord
    deadline: float
    sent: dict[str, int] = field(default_factory=dict)
    """Owner -> payloads it sent (its :class:`~dcr.protocol.messages.SendsDone`)."""
    asked: bool = False
    """A transition asked for it (:class:`DenseAsked`: a disproved or dirty member): the
    receiver's status may still name the record, which its storage does not hold."""


@dataclass(slots=True)
class _Settling:
    record: CommitRecord
    deadline: float


class MembershipCore:
    """The membership of one active coordinator; :meth:`handle` takes an event and returns
    commands.  ``epoch`` is the coordinator epoch it acts in (its lease)."""

    def __init__(self, config: MembershipConfig, *, epoch: int) -> None:
        self.config = config
        self._ids = EpochIds(epoch)
        self.statuses: dict[str, msg.EndpointStatus] = {}
        self.unverified: set[str] = set()
        """Receivers seen, restarted or restored since a complete fingerprint checked them."""
        self._restarted: set[str] = set()
        """Receivers restarted or departed since the running transition began."""
        self._gone: set[str] = set()
        """Receivers that departed and have not reported since: neither members nor joiners."""
        self._jobs: dict[str, _Job] = {}
        self._running: RunTransition | None = None
        self._engaged: frozenset[str] = frozenset()
        """Receivers the running (or settling) transition requires: not dense-refitted."""
        self._settling: _Settling | None = None
        self._staged_since: float | None = None
        self._now: float | None = None
        self._active_since: float | None = None
        self._said: float | None = None

    # -- queries ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._ids.epoch

    @property
    def running(self) -> RunTransition | None:
        """The transition started and not reported done."""
        return self._running

    def members(self, record: CommitRecord) -> tuple[str, ...]:
        """Receivers whose last report says they hold ``record`` exactly and that no dense job a
        transition asked for is restoring: the required ones."""
        return tuple(
            sorted(
                r
                for r in self.config.receivers
                if (s := self.statuses.get(r)) is not None
                and s.record == record
                and not ((job := self._jobs.get(r)) is not None and job.asked)
            )
        )

    def joining(self, record: CommitRecord) -> set[str]:
        """Receivers not (yet) holding ``record``: starting, restoring or behind (not those
        that departed)."""
        return {
            r
            for r in self.config.receivers
            if ((s := self.statuses.get(r)) is None or s.record != record) and r not in self._gone
        }

    def job_of(self, job: int) -> str | None:
        """The receiver dense job ``job`` restores, if it is in flight."""
        return next((r for r, j in self._jobs.items() if j.job == job), None)

    def jobs(self) -> dict[str, int]:
        """Receiver -> its dense job in flight."""
        return {r: j.job for r, j in self._jobs.items()}

    def restarted(self) -> tuple[str, ...]:
        """Endpoints restarted or departed since the running transition began: their old
        process is gone (or out of reach: nothing waits for it)."""
        return tuple(sorted(self._restarted))

    def gone(self) -> tuple[str, ...]:
        """Receivers that departed and have not reported since."""
        return tuple(sorted(self._gone))

    def departable(self) -> set[str]:
        """Receivers whose departure would change something: those that reported, and those
        of a replaced coordinator's attempt the running transition takes over (whether or not
        they reported to this coordinator)."""
        names = {r for r in self.config.receivers if r in self.statuses}
        run = self._running
        if run is not None and run.take_over is not None:
            names |= set(run.take_over.receivers) - self._gone
        return names & set(self.config.receivers)

    def silent(self) -> tuple[list[str], list[str]]:
        """Owners and receivers of the fleet that never reported (departed ones aside)."""
        return (
            sorted(o for o in self.config.owners if o not in self.statuses),
            sorted(
                r for r in self.config.receivers if r not in self.statuses and r not in self._gone
            ),
        )

    # -- events ----------------------------------------------------------------------------

    def handle(self, event: MembershipEvent) -> list[MembershipCommand]:
        """Apply one event; return the commands to execute, in order."""
        out: list[MembershipCommand] = []
        match event:
            case Tick():
                self._on_tick(event, out)
            case msg.EndpointStatus():
                self._on_status(event, out)
            case msg.ReceiverReady(receiver=receiver, record=record, job=job):
                self._on_ready(receiver, record, job, out)
            case msg.SendsDone():
                self._on_sent(event, out)
            case msg.AttemptFailed():
                self._on_failed(event, out)
            case TransitionDone():
                self._on_done(event)
            case DenseAsked(record=record, receivers=receivers):
                for r in sorted(receivers):
                    self._start_job(r, record, out, asked=True)
            case Departed(endpoint=endpoint):
                self._on_departed(endpoint, out)
        return out

    def _on_tick(self, tick: Tick, out: list[MembershipCommand]) -> None:
        now = self._now = tick.now
        if self._active_since is None:
            self._active_since = now
        self._say_silent(now, out)
        settling = self._settling
        if settling is not None and (now >= settling.deadline or self._settled(settling.record)):
            self._settling = None
            self._engaged = frozenset()
        self._refit_joiners(tick.record, now, out)
        if self._running is not None or self._settling is not None:
            return
        old = self._unfinished(tick.record, tick.attempt)
        staged = self._owners_staged(tick.record)
        if staged and self._staged_since is None:
            self._staged_since = now
        waited = now - (self._staged_since if self._staged_since is not None else now)
        joining = self.joining(tick.record)
        if old is None and not (staged and (not joining or waited >= self.config.join_wait_s)):
            return
        self._staged_since = None
        base = old.base if old is not None else tick.record
        members = self.members(base)
        fingerprint = self.config.fingerprint_on_join and bool(self.unverified & set(members))
        run = RunTransition(
            base=base,
            members=members,
            fingerprint=fingerprint,
            take_over=old,
            not_waiting=tuple(sorted(joining)) if old is None else (),
        )
        self._running = run
        self._engaged = frozenset(members)
        self._restarted.clear()
        out.append(run)
        if old is not None:
            # The attempt taken over may bind receivers that departed since: the run goes on
            # without them, and no stop of it waits for them.
            for r in sorted(self._gone & old.receivers):
                self._restarted.add(r)
                out.append(Depart(endpoint=r))

    def _say_silent(self, now: float, out: list[MembershipCommand]) -> None:
        assert self._active_since is not None
        s = self.config.silent_s
        if now - self._active_since < s or (self._said is not None and now - self._said < s):
            return
        owners, receivers = self.silent()
        if owners or receivers:
            self._said = now
            out.append(Say(kind="waiting", fields={"owners": owners, "receivers": receivers}))

    def _settled(self, record: CommitRecord) -> bool:
        """The receivers that took part report the committed record (or restarted, or must
        restore one): the next transition reads its members from their reports."""
        return all(
            (s := self.statuses.get(r)) is not None
            and (s.record == record or s.record is None or r in self._restarted)
            for r in self._engaged
        )

    def _unfinished(self, record: CommitRecord, info: AttemptInfo | None) -> AttemptInfo | None:
        """An attempt a replaced coordinator registered whose transition is not finished:
        not committed while owners still hold its candidate, or committed while some owner
        has not moved its baseline yet."""
        if info is None or info.coordinator >= self.epoch:
            return None
        owners = [self.statuses.get(o) for o in self.config.owners]
        if any(s is None for s in owners):
            return None  # wait until every owner has said where it stands
        if record == info.base and all(s.candidate for s in owners if s is not None):
            return info
        if record == info.target and any(s.record == info.base for s in owners if s is not None):
            return info
        return None

    def _owners_staged(self, record: CommitRecord) -> bool:
        return all(
            (s := self.statuses.get(o)) is not None and s.record == record and s.candidate
            for o in self.config.owners
        )

    def _refit_joiners(
        self, record: CommitRecord, now: float, out: list[MembershipCommand]
    ) -> None:
        """Start, retry or release the dense job of every receiver not holding ``record``."""
        for r in self.config.receivers:
            s = self.statuses.get(r)
            job = self._jobs.get(r)
            if s is not None and s.record == record and (job is None or not job.asked):
                if job is not None:
                    out.append(ReleaseJob(job=self._jobs.pop(r).job))
                continue
            if s is None:
                continue
            if r in self._engaged and (job is None or job.record != record):
                # Part of the running transition: restored only when it asks (a failed
                # proof), and then sent again when that job failed or lapsed.
                continue
            if job is None or job.record != record or now >= job.deadline:
                asked = job is not None and job.asked and job.record == record
                self._start_job(r, record, out, asked=asked)

    def _start_job(
        self,
        receiver: str,
        record: CommitRecord,
        out: list[MembershipCommand],
        *,
        asked: bool = False,
    ) -> None:
        old = self._jobs.get(receiver)
        if old is not None:
            out.append(ReleaseJob(job=old.job))
        job = self._ids.dense_job()
        now = self._now if self._now is not None else 0.0
        self._jobs[receiver] = _Job(
            job=job, record=record, deadline=now + self.config.dense_timeout_s, asked=asked
        )
        out.append(Say(kind="dense", fields={"receiver": receiver, "job": job,
                                             "version": record.version}))  # fmt: skip
        out.append(StartDense(job=job, receiver=receiver, record=record))

    def _on_status(self, status: msg.EndpointStatus, out: list[MembershipCommand]) -> None:
        name = status.endpoint
        before = self.statuses.get(name)
        self.statuses[name] = status
        if name in self._gone:
            # A departed receiver reports again: it rejoins as one seen for the first time.
            self._gone.discard(name)
            out.append(Say(kind="returned", fields={"receiver": name}))
        if before is None and name in self.config.receivers:
            # Seen for the first time: whatever version it claims (an engine started from a
            # checkpoint, a preloaded rank, a receiver of a replaced coordinator's fleet), its
            # storage is fingerprinted completely before the first transition it takes part in.
            self.unverified.add(name)
        if before is not None and before.incarnation != status.incarnation:
            # A new process of that name: the old one is gone for good.
            self._restarted.add(name)
            self.unverified.add(name)
            job = self._jobs.pop(name, None)
            if job is not None:
                out.append(ReleaseJob(job=job.job))
            out.append(Say(kind="restarted", fields={"endpoint": name}))
            if self._running is not None:
                out.append(Retire(endpoint=name))

    def _on_departed(self, name: str, out: list[MembershipCommand]) -> None:
        """A receiver left the fleet: forget its status and job; the running transition goes
        on without it, and no later one requires it or waits for it until it reports again."""
        if name not in self.departable():
            return  # an owner, or a receiver not heard from (or departed already)
        self.statuses.pop(name, None)
        self._gone.add(name)
        self.unverified.add(name)
        self._engaged = self._engaged - {name}
        job = self._jobs.pop(name, None)
        if job is not None:
            out.append(ReleaseJob(job=job.job))
        out.append(Say(kind="departed", fields={"receiver": name}))
        if self._running is not None:
            # Like a restart: the run's fingerprint of it no longer verifies it, and the
            # supervisor answers for it (CheckRetired) so that no stop waits for it.
            self._restarted.add(name)
            out.append(Depart(endpoint=name))

    def _on_ready(
        self, receiver: str, record: CommitRecord, job_id: int | None, out: list[MembershipCommand]
    ) -> None:
        current = self._jobs.get(receiver)
        if job_id is not None and (current is None or current.job != job_id):
            # A job this core no longer runs: a late report of a process that restarted
            # since (its job was released), or of a job a newer one replaced.
            return
        self.unverified.add(receiver)
        status = self.statuses.get(receiver)
        if status is not None:  # its status report follows; do not refit it again
            self.statuses[receiver] = replace(status, record=record)
        job = self._jobs.get(receiver)
        if job is not None and job.record == record:
            del self._jobs[receiver]
            out.append(ReleaseJob(job=job.job))
            out.append(Say(kind="restored", fields={"receiver": receiver,
                                                    "version": record.version}))  # fmt: skip
            # It holds the committed version exactly: it serves again now (a rollout engine
            # that restarted must not wait for the next transition, which may need its
            # rollouts), and joins at the next prepare.
            out.append(ReopenGate(job=job.job, receiver=receiver, record=record))

    def _on_sent(self, done: msg.SendsDone, out: list[MembershipCommand]) -> None:
        receiver = self.job_of(done.attempt)
        if receiver is None:
            return
        job = self._jobs[receiver]
        job.sent[done.owner] = done.payload_count
        if set(job.sent) >= set(self.config.owners):
            # Arrival is checked against the owners' sent lists: a payload lost with a relay
            # node fails the job within the transport's arrival grace, not at its deadline.
            out.append(CheckArrival(job=job.job, receiver=receiver,
                                    expected=tuple(job.sent.items())))  # fmt: skip

    def _on_failed(self, failure: msg.AttemptFailed, out: list[MembershipCommand]) -> None:
        receiver = self.job_of(failure.attempt)
        if receiver is None:
            return
        job = self._jobs[receiver]
        # Retry soon (a baseline update in progress, a damaged payload, ...).
        if self._now is not None:
            job.deadline = min(job.deadline, self._now + self.config.retry_s)
        out.append(Say(kind="dense-failed", fields={
            "receiver": receiver, "job": job.job, "endpoint": failure.endpoint,
            "check": failure.check, "message": failure.message}))  # fmt: skip

    def _on_done(self, done: TransitionDone) -> None:
        run = self._running
        self._running = None
        if done.epoch > self.epoch:
            # The run claimed a newer epoch (it took over): jobs continue above its ids.
            self._ids = EpochIds(done.epoch)
        if run is None:
            return
        if run.fingerprint and done.disproved is not None:
            # The first prepare fingerprinted every member; those that failed are restored
            # by dense refit and become unverified again when they report ready.
            # A member restarted since that prepare checked its old process stays unverified.
            self.unverified -= set(run.members) - done.disproved - self._restarted
        if done.replaced:
            self._engaged = frozenset()
            return
        now = self._now if self._now is not None else 0.0
        self._settling = _Settling(record=done.record, deadline=now + self.config.settle_s)
