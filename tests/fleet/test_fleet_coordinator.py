"""The fleet coordinator's lease between transitions, and the launcher's restarts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from dcr.adapters.commit.memory import MemoryCommitStore
from dcr.errors import CommitConflict
from dcr.fleet.config import load_fleet
from dcr.fleet.coordinator import FleetCoordinator
from dcr.fleet.eventlog import EventLog
from dcr.fleet.launcher import Launcher
from dcr.fleet.processes import _Proc

FLEET = """
[model]
size_mb = 0
refits = 1

[coordinator]
lease_s = 0.2

[[rollout]]
name = "a"
receivers = [{ name = "r0", tp = 1, rank = 0 }]
"""


class _RenewalInFlight(MemoryCommitStore):
    """Its first renewal waits until released (a renewal in flight for a while, as on a
    loaded machine); every renewal's outcome is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[tuple[str, int]] = []
        self.in_flight: anyio.Event | None = None
        self.release: anyio.Event | None = None

    async def renew(self, *, epoch: int, lease_s: float) -> None:
        if not self.outcomes and self.release is not None:
            assert self.in_flight is not None
            self.in_flight.set()
            await self.release.wait()
        try:
            await super().renew(epoch=epoch, lease_s=lease_s)
        except CommitConflict:
            self.outcomes.append(("conflict", epoch))
            raise
        self.outcomes.append(("renewed", epoch))


async def _until(check: Any) -> None:
    with anyio.fail_after(30):
        while not check():
            await anyio.sleep(0.01)


def test_a_transition_claiming_its_epoch_during_a_renewal_is_not_a_replacement(
    tmp_path: Path,
) -> None:
    """Between transitions the process renews the lease itself; when a transition claims the
    next epoch while such a renewal is in flight, the renewal finds a newer epoch in the
    store.  That epoch is the process's own: it keeps coordinating.  Another process's claim
    still ends this one (exit status 3, the launcher restarts it as a standby)."""
    (tmp_path / "fleet.toml").write_text(FLEET)
    cfg = load_fleet(tmp_path / "fleet.toml")
    store = _RenewalInFlight()
    log = EventLog(tmp_path / "events", "coordinator")

    async def scenario() -> None:
        store.in_flight, store.release = anyio.Event(), anyio.Event()
        first = await store.claim(address="here", lease_s=60)
        coordinator = FleetCoordinator(
            owners=(), receivers=(), store=store, control=None, transport=None,  # type: ignore[arg-type]
            config=cfg, log=log, epoch=first,
        )  # fmt: skip

        async def transitions() -> None:
            await store.in_flight.wait()  # a renewal of the first epoch in flight ...
            run = SimpleNamespace(epoch=await store.claim(address="here", lease_s=60))
            coordinator._service = run  # type: ignore[assignment]  # ... as a run claims
            store.release.set()
            await _until(lambda: store.outcomes)
            assert store.outcomes == [("conflict", first)]
            coordinator._service = None  # the run ended; the process renews again
            coordinator.epoch = run.epoch
            await _until(lambda: ("renewed", run.epoch) in store.outcomes)
            await store.claim(address="elsewhere", lease_s=60)  # a standby took over

        async with anyio.create_task_group() as tg:
            tg.start_soon(transitions)
            await coordinator._renew()

    with pytest.raises(BaseException) as raised:
        anyio.run(scenario, backend="asyncio")
    exits = (
        [raised.value] if isinstance(raised.value, SystemExit) else raised.value.exceptions  # type: ignore[attr-defined]
    )
    assert [type(e) for e in exits] == [SystemExit] and exits[0].code == 3
    # The conflict with its own run's epoch, renewals at that epoch, then the real one.
    kinds = [kind for kind, _ in store.outcomes]
    assert kinds[0] == kinds[-1] == "conflict" and set(kinds[1:-1]) == {"renewed"}
    events = [line for line in log.path.read_text().splitlines() if '"replaced"' in line]
    assert len(events) == 1


def test_the_launcher_says_what_a_process_said_last_when_it_restarts_it(tmp_path: Path) -> None:
    """A role that crashed is restarted, and the operator reads why (its log's last line)
    without opening the log; a planned SIGKILL says nothing more."""
    (tmp_path / "fleet.toml").write_text(FLEET)
    cfg = load_fleet(tmp_path / "fleet.toml")
    (cfg.run_dir / "logs").mkdir(parents=True)
    lines: list[str] = []
    launcher = Launcher(cfg, say=lines.append)
    crash = "import sys; print('Traceback ...'); print('CommitStoreError: bad record'); sys.exit(1)"
    proc = _Proc(name="coordinator", role="coordinator", argv=[sys.executable, "-c", crash])
    launcher.procs[proc.name] = proc
    try:
        launcher._spawn(proc)
        assert proc.popen is not None
        proc.popen.wait(60)
        launcher._supervise()
        assert lines == ["coordinator exited (1): CommitStoreError: bad record; restarting it"]
        assert proc.starts == 2 and proc.popen.wait(60) == 1  # the restart crashes again
        proc.argv = [sys.executable, "-c", "import time; print('serving'); time.sleep(60)"]
        launcher._spawn(proc)
        proc.popen.kill()
        proc.popen.wait(60)
        launcher._supervise()
        assert lines[-1] == f"coordinator exited ({-signal.SIGKILL}); restarting it"
    finally:
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(60)
