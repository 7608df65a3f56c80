"""Python mirror of ``models/refit.tla`` and an exhaustive breadth-first model checker.

:mod:`~dcr.testing.spec.state` holds the specification's variables, :mod:`.actions` names
one function per TLA+ action (in :mod:`.streaming`, :mod:`.commit`, :mod:`.recovery` and
:mod:`.environment`, on the vocabulary of :mod:`.steps`), :mod:`.invariants` the safety
properties, and :mod:`.checker` the search that reports the shortest counterexample trace.
:mod:`dcr.testing.spec.membership` mirrors ``models/membership.tla``: runs of several
transitions with joins, restarts, dense refits and takeovers.
"""

from dcr.testing.spec.actions import ACTIONS as ACTIONS
from dcr.testing.spec.actions import ENVIRONMENT as ENVIRONMENT
from dcr.testing.spec.checker import Counterexample as Counterexample
from dcr.testing.spec.checker import Result as Result
from dcr.testing.spec.checker import explore as explore
from dcr.testing.spec.invariants import INVARIANTS as INVARIANTS
from dcr.testing.spec.state import State as State
from dcr.testing.spec.steps import Config as Config
from dcr.testing.spec.steps import initial_state as initial_state
