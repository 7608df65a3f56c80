"""Receivers inside running vLLM engines, end to end (paper §§6-7, G1 on a serving engine).

An engine process (``python -m dcr.integrations.vllm``, plain-weights load format) serves a
stream of greedy requests while its workers, each a receiver rank of a fleet (relay node and
coordinator in their own processes, the trainer's owners in this one), take five refits: in
mixed mode, one whose first attempt is faulted and retried in overwrite mode, and one after
the engine was SIGKILLed, restarted from the initial checkpoint and restored by dense refit.
At that restart the coordinator is restarted in the other RL mode, so every run has
synchronous refits (the gate waits for in-flight requests, payloads apply as they stream) and
asynchronous ones (payloads staged while serving, in-flight requests frozen and finished on
the new weights).  After every commit each worker's parameters equal, bit for bit, those of
an engine started fresh on that version's checkpoint, and the fixed prompts' greedy tokens
and log probabilities equal that engine's.  Every request reports the committed version(s)
that produced its tokens.
"""

from __future__ import annotations

import itertools
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from engine_helpers import (
    EngineServer,
    LongRequest,
    ReferenceRuns,
    Role,
    Stream,
    bit_mismatches,
    coordinator_events,
    fixed_prompts,
    fleet_snapshot,
    group_members,
    open_trainer,
    same_floats,
    write_checkpoints,
    write_fleet,
)

from dcr.adapters.faulty import Faults
from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.integrations.vllm.versions import WeightSpan, label_of, weight_spans
from dcr.protocol.types import CommitRecord

pytestmark = pytest.mark.vllm

REFITS = 5
MAX_TOKENS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    family: str
    tp: int
    sync: bool
    """The RL mode of the refits before the restart (the other one after it)."""
    fault_at: int = 2
    """The refit whose first attempt is faulted (a corrupted payload)."""
    restart_at: int = 3
    """The refit published after the engine was SIGKILLed and restarted."""

    def sync_at(self, version: int) -> bool:
        return self.sync if version < self.restart_at else not self.sync


CASES = {
    "qwen3": Case(family="qwen3", tp=2, sync=False),
    "llama": Case(family="llama", tp=1, sync=True),
    "qwen3_moe": Case(family="qwen3_moe", tp=1, sync=False),
}
DEEP_CASES = {"qwen3_moe"}
"""Run by ``make test-deep`` only: each case starts an engine twice and a fresh engine per
version."""
LONG_TOKENS = 64000
"""Before every asynchronous refit (but the one after the restart) a request this long starts;
it is decoding when the gate closes and is aborted once it decoded a token on the new
weights.  It must outlast the refit: about six minutes of decoding (16,000 tokens once ran
out during a first refit that took 95 s on a machine starved by other engines)."""


def _span(record: CommitRecord, start: int, end: int) -> dict[str, Any]:
    return {"version": record.version, "candidate": record.candidate, "start": start, "end": end}


async def _check(
    engine: EngineServer,
    reference: tuple[dict[str, Any], list[dict[str, Any]]],
    record: CommitRecord,
) -> None:
    """The engine equals a fresh engine on ``record``'s checkpoint: every parameter bit, and
    the fixed prompts' tokens and log probabilities (each generated alone, as there)."""
    params, outputs = reference
    mine = await anyio.to_thread.run_sync(engine.parameters)
    assert bit_mismatches(mine, params) == [], f"version {record.version}"
    for prompt, want in zip(fixed_prompts(), outputs, strict=True):
        out = await anyio.to_thread.run_sync(engine.generate, prompt, MAX_TOKENS)
        assert out["token_ids"] == want["token_ids"], f"version {record.version}"
        assert same_floats(out["logprobs"], want["logprobs"]), f"version {record.version}"
        assert out["weight_versions"] == [_span(record, 0, len(want["token_ids"]))]


def _switch_mode(fleet: Path, *, sync: bool) -> None:
    text = fleet.read_text()
    old, new = f"sync = {str(not sync).lower()}", f"sync = {str(sync).lower()}"
    assert text.count(old) == 1
    fleet.write_text(text.replace(old, new))


def _restored(engine: EngineServer, record: CommitRecord) -> None:
    """Wait until every worker's receiver holds ``record`` (restored by dense refit)."""
    held = [record.version, record.candidate]
    engine.wait_state(
        lambda s: all(w and w["held"] == held for w in s["workers"]), what=f"restored {record}"
    )


def _reopened(engine: EngineServer, record: CommitRecord) -> None:
    """Wait until the engine serves again, its weights labelled ``record``."""
    engine.wait_state(
        lambda s: s["record"] == label_of(record) and not s["closed"], what=f"open at {record}"
    )


async def _scenario(
    case: Case, cfg: FleetConfig, checkpoints: list[Path], references: ReferenceRuns, work: Path
) -> dict[str, Any]:
    """The serving engine (started from version 0), the fleet and the five refits; fresh
    engines on versions 1 .. 5 are ``references``."""
    names = [f"r{r}" for r in range(case.tp)]
    roles = [Role.start(cfg, "relay", "--node", "node0"),
             Role.start(cfg, "coordinator", "--name", "coordinator")]  # fmt: skip
    engines: list[EngineServer] = []
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    cycles: dict[int, dict[str, Any]] = {}
    refit_s: dict[int, float] = {}
    longs: dict[int, dict[str, Any]] = {}
    restart_requests: list[dict[str, Any]] = []

    def start_engine(checkpoint_version: int) -> EngineServer:
        engine = EngineServer.start(
            work / "engine", model=checkpoints[0], tp=case.tp, fleet=cfg.path, receivers=names,
            checkpoint_version=checkpoint_version, name=f"engine-{len(engines)}",
            options=["--expose-parameters"],  # the test reads every weight's bits
        )  # fmt: skip
        engines.append(engine)
        return engine.wait_ready()

    def collect(stream: Stream, engine: EngineServer) -> None:
        results.extend(stream.results)
        failures.extend(stream.failures)
        for cycle in engine.state()["cycles"]:
            cycles[cycle["version"]] = cycle

    try:
        async with AsyncExitStack() as stack:
            trainer = await open_trainer(cfg, stack)
            await trainer.compute(range(1, REFITS + 1))
            engine = await anyio.to_thread.run_sync(start_engine, 0)
            refs = dict(enumerate(await anyio.to_thread.run_sync(references.result), start=1))
            state = engine.state()
            assert state["record"] == label_of(trainer.records[0]) and not state["closed"]
            async with anyio.create_task_group() as tg:
                stream = Stream(engine)
                await tg.start(stream.run)
                for k in range(1, REFITS + 1):
                    if k == case.restart_at:
                        await stream.stop()
                        collect(stream, engine)
                        await anyio.to_thread.run_sync(engine.kill)
                        # The coordinator comes back in the other mode (the engine takes
                        # its default pause mode from the fleet file when it joins).
                        roles[1].stop()
                        _switch_mode(cfg.path, sync=case.sync_at(k))
                        roles[1] = Role.start(cfg, "coordinator", "--name", "coordinator")
                        # Restarted from the initial checkpoint: stale, so the receivers
                        # restore the committed version by dense refit, the engine paused,
                        # and then it serves that version at once (a trainer may need its
                        # rollouts before it can publish the next one).
                        engine = await anyio.to_thread.run_sync(start_engine, 0)
                        await anyio.to_thread.run_sync(_restored, engine, trainer.records[k - 1])
                        await anyio.to_thread.run_sync(_reopened, engine, trainer.records[k - 1])
                        restored = await anyio.to_thread.run_sync(engine.parameters)
                        assert bit_mismatches(restored, refs[k - 1][0]) == []
                        stream = Stream(engine, seed=k)  # on the restored version, then on k
                        await tg.start(stream.run)
                    faults = Faults(corrupt=1) if k == case.fault_at else None
                    frozen = not case.sync_at(k) and k != case.restart_at
                    long = LongRequest(engine, f"long-{k}", [243, 3, 9], LONG_TOKENS)
                    async with anyio.create_task_group() as refit:
                        if frozen:
                            # Decoding when the refit starts, and far from its last token.
                            refit.start_soon(long.run)
                            await long.wait_tokens(1)
                        t0 = time.time()
                        record = await trainer.publish(k, faults)
                        refit_s[k] = time.time() - t0
                        await anyio.to_thread.run_sync(_reopened, engine, record)
                        if frozen:
                            # One more token on the new weights, then the request ends.
                            await long.wait_tokens(long.tokens + 1)
                            await anyio.to_thread.run_sync(engine.abort, long.request_id)
                    if frozen:
                        assert long.result is not None
                        longs[k] = long.result
                    await stream.stop()
                    collect(stream, engine)
                    if k == case.restart_at:
                        restart_requests = list(stream.results)
                    await _check(engine, refs[k], record)
                    if k < REFITS:
                        stream = Stream(engine, seed=10 * k)
                        await tg.start(stream.run)
            records = dict(trainer.records)
    except BaseException:
        print(fleet_snapshot(cfg, engines))
        raise
    finally:
        references.stop()
        for engine in engines:
            engine.stop()
        for role in roles:
            role.stop()
    return {
        "records": records,
        "results": results,
        "failures": failures,
        "cycles": cycles,
        "refit_s": refit_s,
        "restart_requests": restart_requests,
        "longs": longs,
        "events": coordinator_events(cfg),
    }


def _switched_to(result: dict[str, Any], committed: set[tuple[int, str]]) -> list[int]:
    """The request's spans cover its tokens in order, each produced by a committed version,
    versions increasing; returns the versions the weights changed to under it."""
    spans = result["weight_versions"]
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == len(result["token_ids"])
    for a, b in itertools.pairwise(spans):
        assert a["end"] == b["start"] and a["start"] < a["end"] and a["version"] < b["version"]
    assert {(s["version"], s["candidate"]) for s in spans} <= committed
    assert result["switches"] == [s["start"] for s in spans[1:]]
    return [s["version"] for s in spans[1:]]


@pytest.mark.heavy
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "family",
    # The MoE family is also refitted in-process (test_vllm_refit) on every run.
    [pytest.param(f, marks=pytest.mark.deep) if f in DEEP_CASES else f for f in CASES],
)
def test_a_serving_engine_refitted_five_times_equals_fresh_engines(
    family: str, tmp_path: Path
) -> None:
    case = CASES[family]
    cfg = load_fleet(
        write_fleet(tmp_path / "fleet", family=family, tp=case.tp, sync=case.sync, refits=REFITS)
    )
    checkpoints = write_checkpoints(cfg, REFITS + 1, tmp_path / "checkpoints")
    t0 = time.monotonic()
    # The fresh engines run while the fleet and the serving engine start.
    references = ReferenceRuns.start(
        tmp_path / "reference", checkpoints[1:], tp=case.tp, max_tokens=MAX_TOKENS
    )
    report = anyio.run(_scenario, case, cfg, checkpoints, references, tmp_path, backend="asyncio")
    report["seconds"] = f"{time.monotonic() - t0:.0f} s"

    records: dict[int, CommitRecord] = report["records"]
    assert sorted(records) == list(range(REFITS + 1))
    ended = {
        e["base"] + 1: e
        for e in report["events"]
        if e["event"] == "ended" and e["outcome"] == "committed"
    }
    assert sorted(ended) == list(range(1, REFITS + 1))
    modes = {k: [a["mode"] for a in e["attempts"]] for k, e in ended.items()}
    assert modes[case.fault_at] == ["mixed", "overwrite"]
    assert all(modes[k] == ["mixed"] for k in modes if k != case.fault_at)
    restored = [e for e in report["events"] if e["event"] == "restored"]
    assert sorted(e["receiver"] for e in restored) == [f"r{r}" for r in range(case.tp)]
    assert {e["version"] for e in restored} == {case.restart_at - 1}

    # Every request was answered (none failed while the gate was closed) and says which
    # committed version produced which of its tokens.  A request decoding when an asynchronous
    # refit closed the gate was frozen and finished on the new weights: it reports both
    # versions and the token where the weights changed.  Synchronous refits let in-flight
    # requests finish first: nothing straddles them.
    assert report["failures"] == []
    committed = {(r.version, r.candidate) for r in records.values()}
    longs = report["longs"]
    assert sorted(longs) == [
        k for k in range(1, REFITS + 1) if not case.sync_at(k) and k != case.restart_at
    ]
    for k, r in longs.items():
        assert r["finish_reason"] == "abort"
        assert _switched_to(r, committed) == [k], (k, r["weight_versions"])
        (switch,) = r["switches"]
        assert 0 < switch < len(r["token_ids"]) < LONG_TOKENS
    switched = [v for r in report["results"] for v in _switched_to(r, committed)]
    assert all(not case.sync_at(v) for v in switched), switched
    after_restart = report["restart_requests"]
    restored = case.restart_at - 1
    assert after_restart
    assert all(
        span["version"] in (restored, case.restart_at)
        for r in after_restart
        for span in r["weight_versions"]
    )

    starts = {e["base"] + 1: e["t"] for e in report["events"] if e["event"] == "transition"}
    rows = []
    for k in range(1, REFITS + 1):
        cycle = report["cycles"][k]
        e = ended[k]
        rows.append(
            f"v{k} {'sync ' if case.sync_at(k) else 'async'} {'+'.join(modes[k]):17} "
            f"transition {e['t'] - starts[k]:5.2f} s, publish->commit "
            f"{report['refit_s'][k]:5.2f} s, gate closed {cycle['closed_s']:5.2f} s "
            f"(drain {cycle['drain_s']:.2f} s)"
        )
    print(f"\n{family} TP={case.tp}: {len(report['results'])} stream requests, "
          f"{len(switched)} straddled a refit (and {len(longs)} long ones); "
          f"{report['seconds']}")  # fmt: skip
    print("\n".join(rows))
    for k in range(1, REFITS + 1):
        if k != case.restart_at:
            # The gate closed only once the transition had started (the restarted engine's
            # gate was closed from its start until it reopened at its first commit).
            cycle = report["cycles"][k]
            assert starts[k] <= cycle["requested"] <= cycle["paused"] <= cycle["opened"]


def test_weight_spans_of_finished_vllm_outputs() -> None:
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    v1 = CommitRecord(version=1, candidate="g2.8589934592")
    spans = [WeightVersionSpan("default", 0, 1), WeightVersionSpan(label_of(v1), 1, 3)]
    done = CompletionOutput(
        index=0, text="", token_ids=[7, 8, 9], cumulative_logprob=None, logprobs=None,
        finish_reason="length", weight_versions=spans,
    )  # fmt: skip
    assert weight_spans(done) == (
        WeightSpan(record=None, start=0, end=1),  # before a receiver confirmed the weights
        WeightSpan(record=v1, start=1, end=3),
    )
    running = CompletionOutput(index=0, text="", token_ids=[7], cumulative_logprob=None,
                               logprobs=None)  # fmt: skip
    with pytest.raises(ConfigError, match="finished requests"):
        weight_spans(running)
    empty = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
    assert weight_spans(empty) == ()


def test_an_engine_whose_weights_the_cpu_backend_repacked_refuses_to_join(tmp_path: Path) -> None:
    """vLLM's CPU backend prepacks MoE experts on every CPU: without the plain-weights load
    format the workers' prewarm refuses the model and the engine process exits with the
    error, every one of its processes gone."""
    cfg = load_fleet(write_fleet(tmp_path / "fleet", family="qwen3_moe", tp=1, sync=True, refits=1))
    (checkpoint,) = write_checkpoints(cfg, 1, tmp_path / "checkpoints")
    engine = EngineServer.start(
        tmp_path / "engine", model=checkpoint, tp=1, fleet=cfg.path, receivers=["r0"],
        checkpoint_version=0, plain_weights=False,
    )  # fmt: skip
    try:
        assert engine.popen.wait(timeout=300) == 1
        log = engine.log.read_text(errors="replace")
        # Which module is named first depends on the CPU (linears are packed too where a
        # packed GEMM kernel exists); the experts are repacked on every one.
        assert "dcr: the engine cannot join the fleet: LoaderPathUnsupported" in log
        assert "check=repacked" in log and "load_format='dcr_plain'" in log
        assert not engine.ready_file.exists()
    finally:
        engine.kill()
    assert group_members(engine.popen.pid) == []
