"""The loader classification travels through the protocol: each mixed-mode prepare binds the
union of the refused sets its required receivers reported (``Prepare.xor_refused``), the same
set for every endpoint of the attempt; without a report of every member it binds none."""

from __future__ import annotations

import pytest

from dcr.protocol import commands as cmd
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import bound_refused
from dcr.protocol.types import Mode, Stage, TransitionOutcome
from dcr.testing.protocol_world import World
from dcr.testing.spec.state import V1

NORM = "model.norm.weight"
A_LOG = "model.layers.0.A_log"
REPORTS = {"r0": frozenset({NORM}), "r1": frozenset({NORM, A_LOG}), "r2": frozenset()}


def _prepares(w: World) -> list[tuple[tuple[str, ...], msg.Prepare]]:
    """Every prepare call of coordinator 1: the endpoints it went to, and the message."""
    return [
        (c.to, c.message) for c in w.commands(cmd.Call, "c1") if isinstance(c.message, msg.Prepare)
    ]


def test_the_union_of_the_members_reports_is_bound() -> None:
    assert bound_refused(REPORTS, ["r0", "r1", "r2"]) == frozenset({NORM, A_LOG})
    assert bound_refused(REPORTS, ["r0", "r2"]) == frozenset({NORM})
    assert bound_refused(REPORTS, ["r2"]) == frozenset()
    assert bound_refused(REPORTS, []) == frozenset()


def test_without_every_members_report_nothing_is_bound() -> None:
    assert bound_refused(None, ["r0"]) is None
    assert bound_refused(REPORTS, ["r0", "r3"]) is None  # r3 has not reported


def test_a_union_larger_than_a_control_message_carries_is_not_bound() -> None:
    width = 100
    count = msg.XOR_REFUSED_MAX_BYTES // (width + 1)
    names = [f"{i:0{width}d}" for i in range(count + 1)]
    fits = {"r0": frozenset(names[:count])}
    assert msg.refused_size(fits["r0"]) <= msg.XOR_REFUSED_MAX_BYTES
    assert bound_refused(fits, ["r0"]) == fits["r0"]
    over = {**fits, "r1": frozenset(names[count:])}
    assert msg.refused_size(set(names)) > msg.XOR_REFUSED_MAX_BYTES
    assert bound_refused(over, ["r0", "r1"]) is None


@pytest.mark.parametrize("sync", [True, False])
def test_every_endpoint_gets_the_members_union_and_the_transition_commits(sync: bool) -> None:
    w = World(sync=sync, xor_refused=REPORTS)
    w.start()
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED
    [(to, prepare)] = _prepares(w)
    assert set(to) == {"o0", "o1", "r0", "r1", "r2"}  # one message for owners and receivers
    assert prepare.info.mode is Mode.MIXED
    assert prepare.xor_refused == frozenset({NORM, A_LOG})


def test_a_member_that_has_not_reported_binds_none() -> None:
    w = World(xor_refused={r: s for r, s in REPORTS.items() if r != "r1"})
    w.start()
    w.run()
    assert w.outcome() is TransitionOutcome.COMMITTED
    assert [p.xor_refused for _, p in _prepares(w)] == [None]


def test_without_reports_nothing_is_bound() -> None:
    w = World()
    w.start()
    w.run()
    assert [p.xor_refused for _, p in _prepares(w)] == [None]


def test_a_retry_before_admission_binds_the_union_of_its_own_members() -> None:
    """r1 (the only one refusing A_log) restarts before admission: the attempt fails, the
    mixed-mode retry requires r0 and r2 only and binds their union."""
    w = World(xor_refused=REPORTS)
    w.start()
    w.run(until=lambda w: bool(w.indices(lambda m: isinstance(m.event, msg.Prepare))))
    w.crash_receiver("r1")
    w.run()
    prepares = [p for _, p in _prepares(w)]
    assert [p.info.mode for p in prepares] == [Mode.MIXED, Mode.MIXED]
    assert prepares[1].info.receivers == frozenset({"r0", "r2"})
    assert [p.xor_refused for p in prepares] == [frozenset({NORM, A_LOG}), frozenset({NORM})]
    assert w.outcome() is TransitionOutcome.COMMITTED


def test_overwrite_attempts_bind_none() -> None:
    """After admission every retry runs in overwrite mode: nothing travels relative, so
    nothing is bound."""
    w = World(xor_refused=REPORTS)
    w.start()
    w.run(until=lambda w: any(V1 in rx.storage.values() for rx in w.receivers.values()))
    [i] = [i for i, (_, _, s) in enumerate(w.timers) if s is Stage.FLUSH][-1:]
    w.expire(i)
    w.run()
    prepares = [p for _, p in _prepares(w)]
    assert [p.info.mode for p in prepares] == [Mode.MIXED, Mode.OVERWRITE]
    assert [p.xor_refused for p in prepares] == [frozenset({NORM, A_LOG}), None]
    assert w.outcome() is TransitionOutcome.COMMITTED
