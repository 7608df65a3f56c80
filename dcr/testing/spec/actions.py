"""The actions of ``models/refit.tla``, one function per action with the same name.

Every action takes a :class:`~dcr.testing.spec.state.State` and a
:class:`~dcr.testing.spec.steps.Config` and yields the successor states it allows, each with
a label (the action and its arguments) and the lifecycle edges it took.  Phases move only
along :data:`dcr.protocol.lifecycle.EDGES`, so the search can report which edges of the table
it reached.  The actions live with their concept: :mod:`~dcr.testing.spec.streaming`
(admission and streaming, Algorithm B.1), :mod:`~dcr.testing.spec.commit` (the commit),
:mod:`~dcr.testing.spec.recovery` (failure and recovery, Algorithm B.2) and
:mod:`~dcr.testing.spec.environment` (faults); this module names them.
"""

from __future__ import annotations

from dcr.testing.spec import commit as _commit
from dcr.testing.spec import environment as _env
from dcr.testing.spec import recovery as _recovery
from dcr.testing.spec import streaming as _streaming
from dcr.testing.spec.steps import Action

__all__ = ["ACTIONS", "ENVIRONMENT"]

ACTIONS: dict[str, Action] = {
    "prepare": _streaming.prepare,
    "reject": _recovery.reject,
    "send": _streaming.send,
    "ingest": _streaming.ingest,
    "wait_for_requests": _streaming.wait_for_requests,
    "open_apply": _streaming.open_apply,
    "apply": _streaming.apply,
    "flush": _streaming.flush,
    "ack": _streaming.ack,
    "commit": _commit.commit,
    "commit_succeeded": _commit.commit_succeeded,
    "commit_failed": _commit.commit_failed,
    "commit_unknown": _commit.commit_unknown,
    "conflict": _commit.conflict,
    "read_commit": _commit.read_commit,
    "fail": _recovery.fail,
    "mark_obsolete": _recovery.mark_obsolete,
    "stop_and_wait": _recovery.stop_and_wait,
    "cleanup": _recovery.cleanup,
    "baseline_update": _recovery.baseline_update,
    "reopen_gate": _recovery.reopen_gate,
    "take_over": _recovery.take_over,
    "abort": _recovery.abort,
    "dense_refit": _recovery.dense_refit,
    "compare_and_set": _commit.compare_and_set,
    "expire_deadline": _env.expire_deadline,
    "lose_commit_reply": _env.lose_commit_reply,
    "lose_payload": _env.lose_payload,
    "duplicate_payload": _env.duplicate_payload,
    "crash_receiver": _env.crash_receiver,
}
"""Every action of the specification, by name (the TLA+ name in snake case)."""

ENVIRONMENT = frozenset(
    {
        "compare_and_set",
        "expire_deadline",
        "lose_commit_reply",
        "lose_payload",
        "duplicate_payload",
        "crash_receiver",
    }
)
"""Actions of the control plane and the environment rather than protocol triggers."""
