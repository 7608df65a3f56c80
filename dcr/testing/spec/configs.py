"""Named configurations for the model checkers.

One transition (``models/refit.tla``): together the configurations reach every edge of the
table.  ``REQUIRED`` is the configuration the protocol is checked at on every test run: two
owners, three receivers, three attempts and one coordinator failover.  The others are
smaller and each adds what ``REQUIRED`` leaves out (message faults, asynchronous RL, crashes
and dense refits, operator abort, a replaced coordinator that keeps running, two failovers).

Runs of several transitions (``models/membership.tla``): ``MEMBERSHIP_REQUIRED`` (a restart
and a takeover over two transitions) and smaller configurations that each add joins left
behind by the join wait, dense-job faults, settling deadlines, a third transition, foreign
checkpoints, owner restarts, a restart from the committed checkpoint or two takeovers.
"""

from __future__ import annotations

from dataclasses import replace

from dcr.testing.spec.membership.state import RunConfig
from dcr.testing.spec.steps import Config

__all__ = [
    "COVERAGE",
    "HEAVY",
    "MEMBERSHIP_COVERAGE",
    "MEMBERSHIP_REQUIRED",
    "MEMBERSHIP_TODAY",
    "PROPOSED",
    "REQUIRED",
]

REQUIRED = Config(
    owners=2,
    receivers=3,
    max_attempts=3,
    failures=1,
    failovers=1,
    atomic_delivery=True,
    replaced_acts=False,
)
"""Three attempts arise from one failure plus the takeover's overwrite retry."""

COVERAGE: dict[str, Config] = {
    "required": REQUIRED,
    "messages": Config(
        owners=1, receivers=2, max_attempts=2, failures=1, failovers=0, losses=1, duplicates=1,
    ),
    "asynchronous": Config(
        owners=2, receivers=2, max_attempts=2, failures=1, failovers=0, sync=False, losses=1,
    ),
    "crash-and-join": Config(
        owners=1, receivers=2, max_attempts=3, failures=0, failovers=0, crashes=1,
        atomic_delivery=True,
    ),
    "abort": Config(
        owners=1, receivers=2, max_attempts=2, failures=1, failovers=0, aborts=1, crashes=1,
        atomic_delivery=True,
    ),
    "replaced-keeps-running": Config(
        owners=1, receivers=2, max_attempts=2, failures=1, failovers=1, reply_losses=1,
        atomic_delivery=True,
    ),
    "two-failovers": Config(
        owners=1, receivers=1, max_attempts=2, failures=0, failovers=2, aborts=1,
        atomic_delivery=True, replaced_acts=False,
    ),
}  # fmt: skip
"""Configurations whose union of explored steps covers every edge (seconds each, except
``required``)."""

HEAVY: dict[str, Config] = {
    "required-two-failures": Config(
        owners=2, receivers=3, max_attempts=3, failures=2, failovers=1, atomic_delivery=True,
        replaced_acts=False,
    ),
    "required-replaced-keeps-running": Config(
        owners=2, receivers=3, max_attempts=3, failures=1, failovers=1, atomic_delivery=True,
    ),
    "messages-two-owners": Config(
        owners=2, receivers=2, max_attempts=2, failures=1, failovers=0, losses=1, duplicates=1,
    ),
}  # fmt: skip
"""Larger configurations (about a minute each)."""

# -- runs of several transitions (models/membership.tla) -----------------------------------

PROPOSED = {"reopen_while_restoring": False, "verify_restarted": False, "early_retire": True}
"""The fixes the membership model calls for (``RunConfig``'s defaults are today's rules, which
its search shows to violate ``GateServesCommitted`` and ``MembersHoldBase``)."""

_QUIET = RunConfig(
    owners=1, receivers=2, transitions=2, restarts=0, takeovers=0, dense_failures=0, timeouts=0,
    retries=1, settle_timeouts=0, join_waits=0, **PROPOSED,
)  # fmt: skip

MEMBERSHIP_REQUIRED = replace(_QUIET, restarts=1, takeovers=1)
"""Checked on every test run: one owner, two receivers, two transitions, a receiver restart
and a coordinator takeover (with the proposed fixes)."""

MEMBERSHIP_COVERAGE: dict[str, RunConfig] = {
    "restart-and-takeover": MEMBERSHIP_REQUIRED,
    "join-wait": replace(_QUIET, restarts=1, join_waits=1),
    "dense-faults": replace(_QUIET, restarts=1, dense_failures=1, timeouts=1),
    "settling": replace(_QUIET, join_waits=1, settle_timeouts=1),
    "three-transitions": replace(_QUIET, transitions=3, join_waits=1, restarts=1),
    "foreign-checkpoint": replace(_QUIET, foreign=1),
    "owner-restart": replace(_QUIET, owners=2, owner_restarts=1, restarts=1),
    "checkpoint-restart": replace(_QUIET, checkpoints=1, join_waits=1),
    "two-takeovers": replace(_QUIET, transitions=1, takeovers=2),
}
"""Configurations of runs (seconds each, except ``restart-and-takeover``)."""

MEMBERSHIP_TODAY: dict[str, tuple[RunConfig, str]] = {
    "reopen-while-restoring": (
        replace(MEMBERSHIP_REQUIRED, reopen_while_restoring=True), "GateServesCommitted"),
    "restart-before-the-first-prepare": (
        replace(_QUIET, foreign=1, early_retire=False), "MembersHoldBase"),
    "restart-verified-by-the-old-fingerprint": (
        replace(_QUIET, foreign=1, verify_restarted=True), "MembersHoldBase"),
}  # fmt: skip
"""Today's rules, one at a time, and the invariant each violates (tests/model expects the
counterexample until the protocol is fixed)."""
