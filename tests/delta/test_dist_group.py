"""DistTrainingGroup across real processes (gloo on 127.0.0.1): each rank holds only its own
shards, yet the union of every rank's buckets equals, bit for bit, what LocalTrainingGroup
builds for the same plan and versions -- also for FP8 rollouts whose tiles the ranks share (their
maxima exchanged by an all-reduce); the residual flags and gather really cross processes;
a dead or hung peer breaks the group with a typed error instead of a hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dcr.delta.build import BuildConfig
from dcr.delta.dist import DistTrainingGroup
from dcr.delta.group import BucketStreams, LocalTrainingGroup, TrainingGroup
from dcr.delta.layout import ShardSpec, TrainingPlan, TrainLayout, build_plan, stable_hash
from dcr.delta.mapping import ColumnParallel, Replicated
from dcr.delta.residual import ResidualPart, ResidualTask, ScaledCast
from dcr.errors import DcrError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.tensors.fp8 import Fp8Scheme
from dcr.tensors.records import Encoding, Mode, TensorSpec
from dcr.testing.fp8 import grow_first_row_max

LAYOUT = TrainLayout(tp=2, dp=2)
SMALL = BuildConfig(chunk_bytes=16 << 10, bucket_bytes=32 << 10)  # several buckets per owner

Shards = dict[str, torch.Tensor]


def scaled_plan(layout: TrainLayout, rows: int = 8, cols: int = 6) -> tuple[TrainingPlan, Shards]:
    """Canonical ``w = bf16(src * scale)`` plus an affine, replicated ``b``.

    ``src`` (fp32) is split over TP and feeds only the residual task; ``scale`` is replicated
    on every rank.  Part ``r`` is converted on the owner of ``src@tp{r}``, so with ``tp > 1``
    some part always travels to the residual owner of ``w``.
    """
    tp, world = layout.tp, layout.world_size
    canon = TensorSpec(name="w", shape=(rows, cols), dtype=torch.bfloat16)
    bias = TensorSpec(name="b", shape=(cols,), dtype=torch.bfloat16)
    shards, parts = [], []
    for r in range(tp):
        reps = tuple(
            sorted(
                layout.rank(dp=d, ep=e, tp=r) for d in range(layout.dp) for e in range(layout.ep)
            )
        )
        key = f"src@tp{r}"
        shards.append(
            ShardSpec(
                key=key,
                source_name="src",
                shape=(rows // tp, cols),
                dtype=torch.float32,
                mapping=None,
                replicas=reps,
                owner=reps[stable_hash(key) % len(reps)],
                tp_rank=r,
            )
        )
        parts.append(
            ResidualPart(
                inputs=(key, "scale"),
                placement=ColumnParallel("w", canon.shape, r, tp),
                convert=ScaledCast(torch.bfloat16),
            )
        )
    everyone = tuple(range(world))
    shards.append(
        ShardSpec(
            key="scale",
            source_name="scale",
            shape=(),
            dtype=torch.float32,
            mapping=None,
            replicas=everyone,
            owner=stable_hash("scale") % world,
        )
    )
    shards.append(
        ShardSpec(
            key="b",
            source_name="b",
            shape=bias.shape,
            dtype=torch.bfloat16,
            mapping=Replicated("b", bias.shape),
            replicas=everyone,
            owner=stable_hash("b") % world,
        )
    )
    task = ResidualTask(
        spec=canon,
        parts=tuple(parts),
        depends_on=frozenset({*(f"src@tp{r}" for r in range(tp)), "scale"}),
    )
    plan = TrainingPlan(
        layout=layout,
        family=None,
        catalog={"w": canon, "b": bias},
        shards=tuple(shards),
        residual=(task,),
    )
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(rows, cols, generator=gen)
    state = {f"src@tp{r}": src.chunk(tp)[r].contiguous() for r in range(tp)}
    state["scale"] = torch.tensor(1.5)
    state["b"] = torch.randn(cols, generator=gen).to(torch.bfloat16)
    return plan, state


def canonical_of(state: Mapping[str, torch.Tensor], tp: int) -> Shards:
    """The canonical tensors of a :func:`scaled_plan` version."""
    src = torch.cat([state[f"src@tp{r}"] for r in range(tp)])
    return {"w": (src * state["scale"]).to(torch.bfloat16), "b": state["b"].clone()}


# ------------------------------------------------------------------------------ the cases


def llama_case() -> tuple[TrainingPlan, list[Shards]]:
    """A tiny llama at TP=2 x DP=2, three versions at ~3% change."""
    cfg = tiny_config("llama")
    w = random_state_dict(cfg, "llama", seed=11)
    plan = build_plan(
        {n: TensorSpec.of(n, t) for n, t in w.items()}, LAYOUT, family="llama", config=cfg
    )
    versions = [w]
    for seed in (12, 13):
        versions.append(perturb(versions[-1], rate=0.03, seed=seed))
    return plan, [plan.slice(v) for v in versions]


def scaled_case() -> tuple[TrainingPlan, list[Shards]]:
    """Residual task across ranks: v1 source elements (and ``b``), v2 only the scale, v3 only
    ``b`` (no residual input changes, so ``w`` is not required)."""
    plan, v0 = scaled_plan(LAYOUT)
    src0, src1 = v0["src@tp0"].clone(), v0["src@tp1"].clone()
    src0[0, 0] += 1.0
    src1[1, 2] -= 0.5
    v1 = dict(v0, **{"src@tp0": src0, "src@tp1": src1})
    v1["b"] = (v0["b"].float() + 1).to(torch.bfloat16)
    v2 = dict(v1, scale=torch.tensor(1.25))
    v3 = dict(v2, b=(v2["b"].float() * 2).to(torch.bfloat16))
    return plan, [v0, v1, v2, v3]


def fp8_case(block: int | None) -> Callable[[], tuple[TrainingPlan, list[Shards]]]:
    """An FP8 rollout of a tiny qwen3_moe at TP=2 x DP=2 whose tiles the ranks share: the
    row-parallel weights' rows under channel scales, the experts' 16x16 tiles (24 rows per
    rank) under block scales; versions move the first rows' scales, then change 1%."""

    def case() -> tuple[TrainingPlan, list[Shards]]:
        cfg = tiny_config("qwen3_moe")
        w = random_state_dict(cfg, "qwen3_moe", seed=14)
        plan = build_plan({n: TensorSpec.of(n, t) for n, t in w.items()}, LAYOUT,
                          family="qwen3_moe", config=cfg, fp8=Fp8Scheme(block))  # fmt: skip
        assert plan.fp8_shared_tiles()
        versions = [w, grow_first_row_max(perturb(w, rate=0.03, seed=15))]
        versions.append(perturb(versions[-1], rate=0.01, seed=16))
        return plan, [plan.slice(v) for v in versions]

    return case


CASES: dict[str, Callable[[], tuple[TrainingPlan, list[Shards]]]] = {
    "llama": llama_case,
    "scaled": scaled_case,
    "fp8-block": fp8_case(16),
    "fp8-channel": fp8_case(None),
}


def collect(streams: BucketStreams) -> dict[int, list[tuple[bool, list[tuple[Any, ...]]]]]:
    """Per owner rank: its buckets as ``(final, [(name, encoding, indices, values), ...])``."""
    return {
        rank: [
            (b.final, [(i.name, int(i.encoding), i.indices, i.values) for i in b.items]) for b in it
        ]
        for rank, (it, _stats) in streams.items()
    }


def drive(
    group: TrainingGroup, versions: list[Shards], held: Callable[[Shards], Shards]
) -> list[dict[str, Any]]:
    """Stage each later version, build it in both modes plus a dense build, commit."""
    out = []
    for shards in versions[1:]:
        group.stage(held(shards))
        step: dict[str, Any] = {
            "mixed": collect(group.build(mode=Mode.MIXED, xor_allowed=set(group.catalog))),
            "overwrite": collect(group.build(mode=Mode.OVERWRITE, xor_allowed=set(group.catalog))),
            "dense_staged": collect(group.build_dense()),
        }
        if isinstance(group, DistTrainingGroup):
            step["exchange"] = group.exchange
        group.commit()
        step["dense"] = collect(group.build_dense())
        out.append(step)
    return out


def held_by(plan: TrainingPlan, rank: int) -> Callable[[Shards], Shards]:
    keys = [s.key for s in plan.shards if rank in s.replicas]
    return lambda shards: {k: shards[k] for k in keys}


# ------------------------------------------------------------------------------ processes


def _rank_main(rank: int, world: int, port: int, out: str, job: str, timeout_s: float) -> None:
    """One trainer process: join the gloo group, run ``job``, write its result to ``out``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=30)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        result = JOBS[job](rank, timeout_s)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        if job == "cases":
            dist.destroy_process_group()
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip interpreter teardown of a group that may hold broken connections


def _cases_job(rank: int, timeout_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, case in CASES.items():
        plan, versions = case()
        held = held_by(plan, rank)
        group = DistTrainingGroup(plan, rank, held(versions[0]), config=SMALL, timeout_s=timeout_s)
        assert group.ranks == (rank,) and group.failure is None and group.staged is None
        result[name] = drive(group, versions, held)
    return result


def _failure_job(kind: str) -> Callable[[int, float], dict[str, Any]]:
    def job(rank: int, timeout_s: float) -> dict[str, Any]:
        plan, v0 = scaled_plan(TrainLayout(tp=2))
        v1 = dict(v0, scale=torch.tensor(2.0))
        held = held_by(plan, rank)
        group = DistTrainingGroup(plan, rank, held(v0), timeout_s=timeout_s)
        if rank == 1:
            if kind == "dies":
                os._exit(0)
            time.sleep(timeout_s * 2.5)  # hangs past the peers' deadline, then leaves
            return {}
        t0 = time.monotonic()
        with pytest.raises(DcrError) as first:
            group.stage(held(v1))
        elapsed = time.monotonic() - t0
        with pytest.raises(DcrError) as again:
            group.build(mode=Mode.MIXED, xor_allowed=())
        return {
            "check": first.value.check,
            "message": str(first.value),
            "elapsed": elapsed,
            "again": again.value is group.failure,
            "dense_fails": _raises(group.build_dense),
        }

    return job


def _raises(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except DcrError:
        return True
    return False


JOBS: dict[str, Callable[[int, float], dict[str, Any]]] = {
    "cases": _cases_job,
    "dies": _failure_job("dies"),
    "hangs": _failure_job("hangs"),
}


def run_ranks(
    world: int, job: str, tmp: Path, *, timeout_s: float, limit_s: float = 120.0
) -> dict[int, Any]:
    """Start ``world`` spawned trainer processes around a TCP store held here; every process
    is stopped before this returns.  Returns each rank's result (ranks that wrote none are
    absent)."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, store.port, str(tmp), job, timeout_s))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
    errors = {
        r: (tmp / f"{r}.err").read_text() for r in range(world) if (tmp / f"{r}.err").exists()
    }
    assert not errors, errors
    assert all(p.exitcode is not None for p in procs)
    return {
        r: pickle.loads((tmp / f"{r}.pkl").read_bytes())
        for r in range(world)
        if (tmp / f"{r}.pkl").exists()
    }


# ------------------------------------------------------------------------------ tests


def same_buckets(
    a: list[tuple[bool, list[tuple[Any, ...]]]], b: list[tuple[bool, list[tuple[Any, ...]]]]
) -> bool:
    if len(a) != len(b):
        return False
    for (fa, ia), (fb, ib) in zip(a, b, strict=True):
        if fa != fb or len(ia) != len(ib):
            return False
        for x, y in zip(ia, ib, strict=True):
            if x[:2] != y[:2] or not np.array_equal(x[2], y[2]) or not np.array_equal(x[3], y[3]):
                return False
            if x[3].dtype != y[3].dtype:
                return False
    return True


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    world = LAYOUT.world_size
    results = run_ranks(world, "cases", tmp_path_factory.mktemp("dist"), timeout_s=60.0)
    assert sorted(results) == list(range(world))
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_union_of_ranks_equals_local_group(case: str, dist_results: dict[int, Any]) -> None:
    plan, versions = CASES[case]()
    local = drive(LocalTrainingGroup(plan, versions[0], config=SMALL), versions, dict)
    for v, expected in enumerate(local):
        for kind in ("mixed", "overwrite", "dense_staged", "dense"):
            union: dict[int, Any] = {}
            for rank, result in dist_results.items():
                got = result[case][v][kind]
                assert set(got) == {rank}
                union.update(got)
            assert sorted(union) == sorted(expected[kind])
            for rank, buckets in expected[kind].items():
                assert same_buckets(union[rank], buckets), (case, v, kind, rank)
                assert [final for final, _ in buckets] == [False] * (len(buckets) - 1) + [True]
        assert any(items for r in expected["mixed"].values() for _, items in r)
        overwrite = [i for r in expected["overwrite"].values() for _, items in r for i in items]
        assert all(enc == int(Encoding.OVERWRITE) for _, enc, _, _ in overwrite)


def test_residual_flags_and_gather_cross_processes(dist_results: dict[int, Any]) -> None:
    plan, _ = scaled_case()
    dst = plan.residual_owner("w")
    converters = {plan[p.inputs[0]].owner for p in plan.residual[0].parts}
    assert converters - {dst}, "the case must move a part between processes"
    expected = [
        ({"src@tp0", "src@tp1"}, ("w",)),  # v1: source elements changed
        ({"scale"}, ("w",)),  # v2: only the shared scale changed
        (set(), ()),  # v3: only the affine b changed
    ]
    for v, (flagged, required) in enumerate(expected):
        exchanges = {r: res["scaled"][v]["exchange"] for r, res in dist_results.items()}
        for ex in exchanges.values():
            assert ex.flagged == flagged and ex.required == required
        sent = sum(ex.parts_sent for ex in exchanges.values())
        received = exchanges[dst].parts_received
        assert sent == received == (len(converters - {dst}) if required else 0)
        assert sum(ex.bytes_sent for ex in exchanges.values()) == exchanges[dst].bytes_received
        w_ranks = {
            r
            for r, res in dist_results.items()
            for _, items in res["scaled"][v]["mixed"][r]
            for name, *_ in items
            if name == "w"
        }
        assert w_ranks == ({dst} if required else set())


@pytest.mark.parametrize("kind", ["dies", "hangs"])
def test_broken_peer_raises_training_group_error(kind: str, tmp_path: Path) -> None:
    timeout_s = 1.0
    results = run_ranks(2, kind, tmp_path, timeout_s=timeout_s, limit_s=60.0)
    r0 = results[0]
    assert r0["check"] == "training-group"
    assert "training rank 0" in r0["message"] and "residual-flags" in r0["message"]
    assert r0["elapsed"] < timeout_s + 5
    assert r0["again"] and r0["dense_fails"]
