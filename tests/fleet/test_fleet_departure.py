"""The fleet coordinator lets a receiver depart once its control connection has been gone for
``[coordinator] depart_after_s`` (or at once when a supervisor reports it lost)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from dcr.adapters.commit.memory import MemoryCommitStore
from dcr.errors import ConfigError
from dcr.fleet.config import load_fleet
from dcr.fleet.coordinator import STALL_S, FleetCoordinator
from dcr.fleet.eventlog import EventLog
from dcr.protocol import messages as msg
from dcr.protocol.membership import RunTransition, Tick
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode

FLEET = """
[model]
size_mb = 0
refits = 1

[coordinator]
depart_after_s = {depart}

[[rollout]]
name = "a"
receivers = [{{ name = "r0", tp = 1, rank = 0 }}, {{ name = "r1", tp = 1, rank = 0 }}]
"""

K0 = CommitRecord(version=0, candidate="g0")


def _coordinator(tmp_path: Path, depart: float, connected: set[str] | None) -> FleetCoordinator:
    (tmp_path / "fleet.toml").write_text(FLEET.format(depart=depart))
    cfg = load_fleet(tmp_path / "fleet.toml")
    c = FleetCoordinator(
        owners=cfg.owners,
        receivers=("r0", "r1"),
        store=MemoryCommitStore(),
        control=None,  # type: ignore[arg-type]
        transport=None,  # type: ignore[arg-type]
        config=cfg,
        log=EventLog(tmp_path / "events", "coordinator"),
    )
    c.membership = c._core(1)
    if connected is not None:
        c._link = SimpleNamespace(endpoints=lambda: dict.fromkeys(connected))  # type: ignore[assignment]
    for r in ("r0", "r1"):
        c.membership.handle(
            msg.EndpointStatus(endpoint=r, role="receiver", incarnation="i0", record=K0)
        )
    return c


def test_a_receiver_unreachable_past_the_bound_departs(tmp_path: Path) -> None:
    connected = {"r0", "r1"}
    c = _coordinator(tmp_path, 30.0, connected)
    assert c._unreachable(0.0) == []
    connected.discard("r1")
    assert c._unreachable(1.0) == []
    assert c._unreachable(29.5) == []  # last seen connected at 0 s
    assert c._unreachable(30.5) == ["r1"]
    assert c._unreachable(31.5) == []  # (it departs once)


def test_a_receiver_that_reconnects_in_time_stays(tmp_path: Path) -> None:
    connected = {"r0", "r1"}
    c = _coordinator(tmp_path, 30.0, connected)
    connected.discard("r1")
    assert c._unreachable(0.0) == []
    connected.add("r1")
    assert c._unreachable(20.0) == []
    connected.discard("r1")
    assert c._unreachable(45.0) == []  # gone since 20 s only
    assert c._unreachable(50.5) == ["r1"]


def test_no_departure_without_a_bound_or_a_link_that_says_who_is_connected(
    tmp_path: Path,
) -> None:
    assert _coordinator(tmp_path, 0.0, set())._unreachable(1e6) == []
    c = _coordinator(tmp_path, 30.0, None)
    c._link = SimpleNamespace()  # type: ignore[assignment]
    assert c._unreachable(0.0) == [] and c._unreachable(1e6) == []


def test_a_departed_receiver_leaves_the_membership_and_a_report_departs_at_once(
    tmp_path: Path,
) -> None:
    connected = {"r0"}
    c = _coordinator(tmp_path, 30.0, connected)
    assert c._unreachable(0.0) == []

    async def scenario() -> None:
        async with anyio.create_task_group() as tg:
            c._tg = tg
            c.depart(["r1"])
            await c._depart_gone(0.0)
            assert c.members(K0) == ("r0",)
            assert c.membership is not None and c.membership.gone() == ("r1",)
            # Gone already: the watch does not depart it again.
            assert c._unreachable(100.0) == []
            tg.cancel_scope.cancel()

    anyio.run(scenario)
    assert '"departed"' in _events(tmp_path)


def _events(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in (tmp_path / "events").glob("*") if p.is_file())


def test_a_standby_keeps_a_lost_report_for_the_attempt_it_takes_over(tmp_path: Path) -> None:
    """The active coordinator is lost with the receivers' node; the standby that takes over
    its attempt lets the receivers reported lost depart at once, not ``depart_after_s``
    later (it never heard from them: they died before it became active)."""
    (tmp_path / "fleet.toml").write_text(FLEET.format(depart=600.0))
    cfg = load_fleet(tmp_path / "fleet.toml")
    c = FleetCoordinator(
        owners=cfg.owners, receivers=("r0", "r1"), store=MemoryCommitStore(), control=None,  # type: ignore[arg-type]
        transport=None, config=cfg, log=EventLog(tmp_path / "events", "coordinator-1"),  # type: ignore[arg-type]
    )  # fmt: skip
    c.depart(["r1", "not-a-receiver"])  # a standby: no membership yet
    assert c.membership is None and c._reported_lost() == []
    core = c.membership = c._core(5)
    for o in cfg.owners:
        core.handle(msg.EndpointStatus(endpoint=o, role="owner", incarnation="i0", record=K0,
                                       candidate=True))  # fmt: skip
    core.handle(msg.EndpointStatus(endpoint="r0", role="receiver", incarnation="i0", record=K0))
    assert c._reported_lost() == []  # not known to this coordinator yet: kept
    old = AttemptInfo(
        attempt=3, candidate="g1.3", base=K0, mode=Mode.MIXED, sync=True, coordinator=1,
        owners=cfg.owners, receivers=frozenset({"r0", "r1"}),
    )  # fmt: skip
    out = core.handle(Tick(now=0.0, record=K0, attempt=old))
    [run] = [x for x in out if isinstance(x, RunTransition)]
    assert run.take_over == old and "r1" in core.departable()

    async def scenario() -> None:
        await c._depart_gone(0.0)  # the tick after: r1 departs (no transition service yet)

    anyio.run(scenario)
    assert core.gone() == ("r1",) and c._reported_lost() == []
    assert '"departed"' in _events(tmp_path) and '"r1"' in _events(tmp_path)


def test_a_lost_receiver_that_reports_again_stays(tmp_path: Path) -> None:
    c = _coordinator(tmp_path, 600.0, {"r0"})
    c.depart(["r1"])
    assert c._lost == {"r1"}

    class Link:
        async def replies(self):  # type: ignore[no-untyped-def]
            yield msg.EndpointStatus(endpoint="r1", role="receiver", incarnation="i1", record=K0)

    async def report() -> None:
        with anyio.fail_after(5):
            await c._dispatch(Link())  # type: ignore[arg-type]

    anyio.run(report)
    assert c._lost == set() and c._reported_lost() == [] and c.membership is not None
    assert c.membership.gone() == ()


def test_the_bound_is_a_coordinator_setting(tmp_path: Path) -> None:
    (tmp_path / "fleet.toml").write_text(FLEET.format(depart=-1))
    with pytest.raises(ConfigError, match="depart_after_s"):
        load_fleet(tmp_path / "fleet.toml")
    (tmp_path / "fleet.toml").write_text(FLEET.format(depart=12.5))
    assert load_fleet(tmp_path / "fleet.toml").coordinator.depart_after_s == 12.5


def test_a_coordinator_that_did_not_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    connected = {"r0", "r1"}
    c = _coordinator(tmp_path, 30.0, connected)
    assert c._unreachable(0.0) == []
    connected.discard("r1")  # gone at 0 s; then the coordinator does not run for 36 s
    c._check_stall(0.1)
    c._check_stall(0.1 + STALL_S - 0.5)
    assert '"stalled"' not in _events(tmp_path)
    c._check_stall(36.1)
    [line] = [x for x in _events(tmp_path).splitlines() if '"stalled"' in x]
    assert json.loads(line)["seconds"] == 36.0
    assert "did not run for 36.0 s" in capsys.readouterr().err
    # The 4.5 + 36 s it did not run do not count: r1 departs after 30 s watched, at 70.5 s.
    assert c._unreachable(40.0) == []
    assert c._unreachable(70.4) == []
    assert c._unreachable(70.6) == ["r1"]
