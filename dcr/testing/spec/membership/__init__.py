"""Python mirror of ``models/membership.tla``: runs of several transitions with joining,
restarted and restored receivers, dense-refit jobs and coordinator takeovers.

:mod:`~dcr.testing.spec.membership.state` holds the variables,
:mod:`~dcr.testing.spec.membership.rules` the membership core's rules (a mirror of
:class:`dcr.protocol.membership.MembershipCore`), :mod:`~dcr.testing.spec.membership.actions`
every action and :mod:`~dcr.testing.spec.membership.invariants` the safety properties;
:data:`MEMBERSHIP` is the model for :func:`dcr.testing.spec.checker.explore`.
"""

from dcr.testing.spec.checker import Model
from dcr.testing.spec.membership.actions import ACTIONS, initial_state
from dcr.testing.spec.membership.invariants import INVARIANTS
from dcr.testing.spec.membership.state import RunConfig as RunConfig
from dcr.testing.spec.membership.symmetry import canonical

__all__ = ["MEMBERSHIP", "RunConfig"]

MEMBERSHIP = Model(
    initial=initial_state, actions=ACTIONS, invariants=INVARIANTS, canonical=canonical
)
"""Runs of several transitions, with joins, restarts, dense refits and takeovers."""
