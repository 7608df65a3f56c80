"""A typed wrapper around :class:`transitions.Machine`, built from the protocol's edge table.

The wrapper keeps the library's bookkeeping (states, conditions, one event per trigger) but
removes what makes state machines hard to follow: there are no ``to_<state>()`` back doors
(``auto_transitions=False``), no methods attached to a model at runtime, and no queued or
asynchronous firing.  A step happens only through :meth:`StateMachine.fire`;
an illegal ``(phase, trigger)`` pair or a refusing guard raises
:class:`~dcr.errors.LocalProtocolError` and leaves the phase unchanged (the h11 habit).
Guards are pure predicates and there are no callbacks: a core updates its own state and
appends commands after :meth:`StateMachine.fire` returns, so no step ever fires another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic

from transitions import EventData, Machine

from dcr.errors import LocalProtocolError
from dcr.protocol.lifecycle import P, Trigger, edges_of, initial_phase

__all__ = ["Guard", "StateMachine"]

Guard = Callable[..., str | None]
"""Called with the ``data`` given to :meth:`StateMachine.fire`; returns ``None`` when the step
may happen, or the reason it may not."""


class _Machine(Machine):
    """``transitions.Machine`` that attaches nothing to the model.

    The library would add ``trigger``, ``may_<trigger>`` and ``is_<state>`` methods (and with
    ``model_override`` log a warning for each one it skips); all firing goes through
    :meth:`StateMachine.fire` instead.
    """

    def _checked_assignment(self, model: object, name: str, func: object) -> None:
        return None


class _Model:
    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase: object = None


class StateMachine(Generic[P]):
    """One lifecycle's state machine; steps only through :meth:`fire`."""

    def __init__(
        self,
        lifecycle: type[P],
        *,
        name: str,
        initial: P | None = None,
        guards: Mapping[Trigger, Guard] | None = None,
        attempt: int | None = None,
    ) -> None:
        self.name = name
        self.attempt = attempt
        """Attempt id named in error messages (``None`` when no attempt applies)."""
        self._lifecycle: type[P] = lifecycle
        self._guards = dict(guards or {})
        self._table: dict[tuple[P, Trigger], P] = {
            (e.source, e.trigger): e.dest for e in edges_of(lifecycle)
        }
        self._refusal: str | None = None
        self._model = _Model()
        self._machine = _Machine(
            model=self._model,
            states=list(lifecycle),
            transitions=[
                {
                    "trigger": e.trigger.value,
                    "source": e.source,
                    "dest": e.dest,
                    "conditions": [self._condition(e.trigger)] if e.trigger in self._guards else [],
                }
                for e in edges_of(lifecycle)
            ],
            initial=initial if initial is not None else initial_phase(lifecycle),
            auto_transitions=False,
            queued=False,
            send_event=True,
            model_attribute="phase",
        )

    @property
    def phase(self) -> P:
        assert isinstance(self._model.phase, self._lifecycle)
        return self._model.phase

    def dest(self, trigger: Trigger) -> P | None:
        """Where ``trigger`` would lead from the current phase, or ``None`` if it is illegal."""
        return self._table.get((self.phase, trigger))

    def can_fire(self, trigger: Trigger, **data: object) -> bool:
        """Whether :meth:`fire` would succeed now (edge exists and its guard allows it)."""
        if self.dest(trigger) is None:
            return False
        guard = self._guards.get(trigger)
        return guard is None or guard(**data) is None

    def fire(self, trigger: Trigger, **data: object) -> P:
        """Take the edge ``(phase, trigger)`` and return the new phase.

        Raises :class:`~dcr.errors.LocalProtocolError` (phase unchanged) when the edge is not
        in the table or its guard refuses.
        """
        before = self.phase
        if self.dest(trigger) is None:
            raise LocalProtocolError(
                f"{self.name}: {trigger.value} is not allowed in phase {before.value}",
                attempt=self.attempt,
                check="transition",
            )
        self._refusal = None
        if not self._machine.events[trigger.value].trigger(self._model, **data):
            raise LocalProtocolError(
                f"{self.name}: {trigger.value} refused in phase {before.value}: {self._refusal}",
                attempt=self.attempt,
                check="guard",
            )
        return self.phase

    def _condition(self, trigger: Trigger) -> Callable[[EventData], bool]:
        guard = self._guards[trigger]

        def condition(event: EventData) -> bool:
            self._refusal = guard(**event.kwargs)
            return self._refusal is None

        return condition

    def __repr__(self) -> str:
        return f"StateMachine({self.name!r}, phase={self.phase.value!r})"
