"""The control plane of the protocol worlds: the commit store as the engine contract specifies
it (paper App. B.2) -- it registers an attempt only from the active coordinator and only while
the record still holds the attempt's base, executes a compare-and-set only from the active
coordinator, never after the attempt's commit deadline or obsolete mark, and answers
``read_commit`` and ``mark_obsolete``.  Its requests and answers are never lost (a lost commit
reply is a separate fault of the world)."""

from __future__ import annotations

from typing import Protocol

from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol.types import AttemptInfo, CommitOutcome, CommitRecord
from dcr.testing.spec.state import Cas, Reply
from dcr.testing.world_messages import Kind, Message

__all__ = ["StoreHost", "serve"]


class StoreHost(Protocol):
    """A world that holds the control plane's state and posts its answers."""

    record: CommitRecord
    epoch: int
    registered: AttemptInfo | None
    obsolete: set[int]
    expired: set[int]
    commit_epoch: int
    cas: dict[int, Cas]
    replies: dict[int, Reply]
    messages: list[Message]
    problems: list[str]

    def _post(self, kind: Kind, to: str, event: object) -> None: ...


def serve(host: StoreHost, m: Message) -> None:
    """Execute the control-plane request ``m`` (sent by coordinator ``m.epoch``) and post the
    answer to its sender."""
    request = m.event
    to = f"c{m.epoch}"
    if isinstance(request, cmd.RegisterAttempt):
        info = request.info
        if m.epoch != host.epoch or host.record != info.base:
            host._post(Kind.STORE_REPLY, to, ev.Conflict(attempt=info.attempt))
        else:
            host.registered = info
            host._post(Kind.STORE_REPLY, to, ev.Registered(attempt=info.attempt))
    elif isinstance(request, cmd.CompareAndSet):
        tau = request.attempt
        if m.epoch != host.epoch:
            outcome = CommitOutcome.CONFLICT
        elif tau in host.obsolete or tau in host.expired:
            outcome = (
                CommitOutcome.FAILED if host.record == request.expected else CommitOutcome.CONFLICT
            )
        elif host.record == request.expected:
            host.record = request.new
            host.commit_epoch = host.epoch
            outcome = CommitOutcome.SUCCEEDED
        else:
            outcome = CommitOutcome.CONFLICT
        host.cas[tau] = Cas.DONE
        host.replies[tau] = Reply[outcome.name]
        host._post(Kind.STORE_REPLY, to, ev.CommitReplied(attempt=tau, outcome=outcome))
    elif isinstance(request, cmd.ReadCommit):
        tau = request.attempt
        pending = any(
            x.kind is Kind.STORE
            and isinstance(x.event, cmd.CompareAndSet)
            and x.event.attempt == tau
            for x in host.messages
        )
        if pending and tau not in host.expired and tau not in host.obsolete:
            host.problems.append(f"read_commit({tau}) while its commit could still land")
        host._post(Kind.STORE_REPLY, to, ev.CommitRead(attempt=tau, record=host.record))
    elif isinstance(request, cmd.RecordObsolete):
        host.obsolete.add(request.attempt)
        host._post(Kind.STORE_REPLY, to, ev.ObsoleteMarked(attempt=request.attempt))
