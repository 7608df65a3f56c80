"""The retry after a failed proof of the base version waits (bounded) for the receivers it
disproved: they are restored by dense refit, join the retry and take part in the commit."""

from __future__ import annotations

import pytest

from dcr.errors import ConfigError
from dcr.protocol import commands as cmd
from dcr.protocol import events as ev
from dcr.protocol import messages as msg
from dcr.protocol.coordinator import CoordinatorConfig, CoordinatorCore
from dcr.protocol.proof import Proof, ProofConfig, ProofRequest, TensorProof
from dcr.protocol.types import AttemptInfo, CommitRecord, CounterIds, Stage

BASE = CommitRecord(version=0, candidate="g0")


def _registered(out: list[cmd.CoordinatorCommand]) -> list[AttemptInfo]:
    return [c.info for c in out if isinstance(c, cmd.RegisterAttempt)]


def _disprove_r0(join_wait_s: float) -> tuple[CoordinatorCore, int, list[cmd.CoordinatorCommand]]:
    """r0 and r1 are required; r0's sampled bits differ from the owner's.  Returns the core,
    the failed attempt and the commands of its cleanup."""
    core = CoordinatorCore(
        CoordinatorConfig(
            base=BASE,
            owners=("o0",),
            receivers=("r0", "r1"),
            epoch=1,
            proof=ProofConfig(samples=1),
            join_wait_s=join_wait_s,
        ),
        CounterIds(),
    )
    [info] = _registered(core.handle(ev.StartTransition()))
    tau = info.attempt
    [prepare] = [
        c.message
        for c in core.handle(ev.Registered(attempt=tau))
        if isinstance(c, cmd.Call) and isinstance(c.message, msg.Prepare)
    ]
    request = prepare.proof
    assert isinstance(request, ProofRequest) and not request.fingerprint

    def proof(bits: int) -> Proof:
        return Proof(seed=request.seed, tensors=(TensorProof(name="w", samples=(0, bits)),))

    core.handle(msg.PrepareAccepted(attempt=tau, endpoint="o0", proof=proof(5)))
    core.handle(msg.PrepareAccepted(attempt=tau, endpoint="r1", proof=proof(5)))
    out = core.handle(msg.PrepareAccepted(attempt=tau, endpoint="r0", proof=proof(6)))
    assert [c.receivers for c in out if isinstance(c, cmd.RequestDenseRefit)] == [{"r0"}]
    assert set(core.verdicts[0].failed) == {"r0"}
    core.handle(ev.ObsoleteMarked(attempt=tau))
    out = []
    for endpoint in ("o0", "r0", "r1"):
        out += core.handle(msg.Stopped(attempt=tau, endpoint=endpoint))
    assert any(isinstance(c, cmd.ReleaseDelivery) for c in out)  # cleaned up
    return core, tau, out


def test_the_retry_waits_for_the_disproved_receiver_and_it_joins():
    core, tau, out = _disprove_r0(join_wait_s=30.0)
    assert _registered(out) == []
    assert [c.seconds for c in out if isinstance(c, cmd.ArmDeadline) and c.stage is Stage.JOIN]
    # A ready report of another record does not end it.
    other = CommitRecord(version=7, candidate="g7")
    assert _registered(core.handle(msg.ReceiverReady(receiver="r0", record=other))) == []
    [info] = _registered(core.handle(msg.ReceiverReady(receiver="r0", record=BASE)))
    assert info.attempt > tau and info.receivers == {"r0", "r1"}
    [prepare] = [
        c.message
        for c in core.handle(ev.Registered(attempt=info.attempt))
        if isinstance(c, cmd.Call) and isinstance(c.message, msg.Prepare)
    ]
    assert prepare.proof is not None and prepare.proof.fingerprint  # the joiner is fingerprinted
    # The wait's deadline, now stale, changes nothing.
    assert core.handle(ev.DeadlineExpired(attempt=tau, stage=Stage.JOIN)) == []


def test_the_wait_is_bounded_then_the_retry_runs_without_it():
    core, tau, out = _disprove_r0(join_wait_s=30.0)
    assert _registered(out) == []
    [info] = _registered(core.handle(ev.DeadlineExpired(attempt=tau, stage=Stage.JOIN)))
    assert info.receivers == {"r1"}
    # A late ready report: r0 joins the next prepare, this one goes on without it.
    assert _registered(core.handle(msg.ReceiverReady(receiver="r0", record=BASE))) == []


def test_an_operator_abort_during_the_wait_ends_the_transition():
    core, _, _ = _disprove_r0(join_wait_s=30.0)
    out = core.handle(ev.OperatorAbort(reason="stop"))
    assert [c.outcome.value for c in out if isinstance(c, cmd.TransitionEnded)] == ["aborted"]
    assert _registered(core.handle(msg.ReceiverReady(receiver="r0", record=BASE))) == []


def test_without_a_wait_the_retry_runs_at_once():
    _, _, out = _disprove_r0(join_wait_s=0.0)
    [info] = _registered(out)
    assert info.receivers == {"r1"}
    with pytest.raises(ConfigError, match="join_wait_s"):
        CoordinatorConfig(base=BASE, owners=("o0",), receivers=(), epoch=1, join_wait_s=-1)
