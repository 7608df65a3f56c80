"""Named configurations for the model checker; together they reach every edge of the table.

``REQUIRED`` is the configuration the protocol is checked at on every test run: two owners,
three receivers, three attempts and one coordinator failover.  The others are smaller and
each adds what ``REQUIRED`` leaves out (message faults, asynchronous RL, crashes and dense
refits, operator abort, a replaced coordinator that keeps running, two failovers).
"""

from __future__ import annotations

from dcr.testing.spec.steps import Config

__all__ = ["COVERAGE", "HEAVY", "REQUIRED"]

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
