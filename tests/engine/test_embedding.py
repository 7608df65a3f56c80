"""The engine embedded in a plain asyncio program, the way a trainer or a vLLM worker hosts it:
``open_owner`` / ``open_receiver`` / ``open_coordinator`` awaited in the test's own asyncio event
loop (pytest-asyncio, strict mode) and once more on uvloop, a SQLite commit store on disk, and
an operator abort that keeps the gate closed until a dense refit.

These tests use pytest-asyncio only; the anyio pytest plugin drives other files."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
import torch

from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.control import MemoryControl
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.sources import StateDictSource
from dcr.adapters.transport import MemoryTransport
from dcr.apply.applier import Applier, xor_allowed_across
from dcr.delta.build import BuildConfig
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.layout import TrainLayout
from dcr.engine import (
    Integration,
    ReceiverHooks,
    ReceiverService,
    TrainingSide,
    open_coordinator,
    open_owner,
    open_receiver,
)
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol import commands as cmd
from dcr.protocol.types import CommitRecord, Mode, Timeouts, TransitionOutcome

FAMILY = "qwen3"
SERVING = (1, 2)
TIMEOUTS = Timeouts(prepare_s=5, arrival_s=2, gate_s=10, flush_s=10, commit_s=2, stop_s=10)


@dataclass
class Gate:
    """Request-gate hooks that record what the engine asked of the serving runtime."""

    calls: list[str] = field(default_factory=list)

    def hooks(self, name: str) -> ReceiverHooks:
        async def close() -> None:
            self.calls.append(f"{name}:close")

        async def invalidate() -> None:
            self.calls.append(f"{name}:invalidate")

        async def open_() -> None:
            self.calls.append(f"{name}:open")

        return ReceiverHooks(close_gate=close, invalidate_kv_cache=invalidate, open_gate=open_)


@dataclass
class Supervisor:
    """Restores receivers by a dense load of the committed canonical state."""

    services: dict[str, ReceiverService]
    committed: dict[CommitRecord, Mapping[str, torch.Tensor]]
    refits: list[str] = field(default_factory=list)

    def retired(self) -> Iterable[str]:
        return ()

    async def dense_refit(self, record: CommitRecord, receivers: frozenset[str]) -> None:
        for name in sorted(receivers):
            self.refits.append(name)
            await self.services[name].dense_refit(self.committed[record], record)


@dataclass
class Ended:
    """How one transition ended, as the embedding program sees it."""

    outcome: TransitionOutcome
    record: CommitRecord
    modes: list[Mode]  # mode of each attempt the coordinator registered
    xor_entries: int  # relative (XOR and ULP) entries the owners built for the first attempt


def _ranks(cfg: dict, state: Mapping[str, torch.Tensor]) -> list[ShardedServingLoader]:
    return [
        ShardedServingLoader.dense(cfg, FAMILY, state, tp_size=tp, tp_rank=r)
        for tp in SERVING
        for r in range(tp)
    ]


def _assert_hold(ranks: list[ShardedServingLoader], cfg: dict, state: Mapping) -> None:
    for i, (got, want) in enumerate(zip(ranks, _ranks(cfg, state), strict=True)):
        assert module_bit_mismatches(got.module, want.module) == [], f"rank {i}"


async def _fleet(tmp_path: Path) -> None:
    cfg = tiny_config(FAMILY)
    v0 = random_state_dict(cfg, FAMILY, seed=3)
    source = StateDictSource(v0, layout=TrainLayout(tp=2, dp=2), family=FAMILY, config=cfg)
    group = LocalTrainingGroup(
        source.plan, source.base_shards(), config=BuildConfig(chunk_bytes=4096, bucket_bytes=8192)
    )
    ranks = _ranks(cfg, v0)
    receivers = {f"r{i}": Applier(loader, source.catalog) for i, loader in enumerate(ranks)}
    for r in receivers.values():
        r.prewarm()
    integration = Integration(
        catalog=source.catalog,
        xor_names=xor_allowed_across(receivers.values()),
        owner_ids={f"o{rank}": rank for rank in range(source.plan.layout.world_size)},
    )
    store = SqliteCommitStore(tmp_path / "commit.db")
    base = (await store.read()).record
    control, transport = MemoryControl(), MemoryTransport()
    side = TrainingSide(group, integration.xor_names)
    gate = Gate()
    services: dict[str, ReceiverService] = {}  # served below
    supervisor = Supervisor(services, {base: v0})

    async def transition(
        update: Mapping[str, torch.Tensor],
        *,
        mode: Mode = Mode.MIXED,
        abort_after_first_apply: bool = False,
    ) -> Ended:
        group.stage(source.candidate_shards(update))
        async with open_coordinator(
            owners=integration.owner_ids,
            receivers=sorted(services),
            store=store,
            control=control,
            transport=transport,
            timeouts=TIMEOUTS,
            supervisor=supervisor,
            mode=mode,
        ) as coordinator:
            if abort_after_first_apply:
                loop = asyncio.get_running_loop()

                def abort_once(key: object) -> None:
                    # Runs in the apply worker thread, after a payload landed in place.
                    services["r0"].on_applied = None
                    fut = asyncio.run_coroutine_threadsafe(coordinator.abort("operator"), loop)
                    fut.result(timeout=10)

                services["r0"].on_applied = abort_once
            ended = await coordinator.run()
        if ended.outcome is TransitionOutcome.COMMITTED:
            supervisor.committed[ended.record] = update
        else:
            group.discard()
        attempts = [c.info for c in coordinator.commands if isinstance(c, cmd.RegisterAttempt)]
        return Ended(
            outcome=ended.outcome,
            record=ended.record,
            modes=[a.mode for a in attempts],
            xor_entries=side.stats(attempts[0].attempt).xor_entries
            + side.stats(attempts[0].attempt).ulp_entries,
        )

    async with AsyncExitStack() as stack:
        for rank in range(source.plan.layout.world_size):
            owner = open_owner(
                name=f"o{rank}",
                rank=rank,
                side=side,
                integration=integration,
                control=control,
                transport=transport,
                store=store,
                baseline=base,
            )
            await stack.enter_async_context(owner)
        for name, r in receivers.items():
            served = open_receiver(
                name=name,
                receiver=r,
                integration=integration,
                control=control,
                transport=transport,
                held=base,
                hooks=gate.hooks(name),
            )
            services[name] = await stack.enter_async_context(served)

        # 1. An operator abort after writes landed: no commit, the dirty receivers are
        #    restored by dense refit, and only then does the gate reopen.
        v1 = perturb(v0, rate=0.05, seed=1)
        ended = await transition(v1, abort_after_first_apply=True)
        assert ended.outcome is TransitionOutcome.ABORTED
        assert ended.record == base and (await store.read()).record == base
        assert "r0" in supervisor.refits
        _assert_hold(ranks, cfg, v0)
        assert gate.calls.index("r0:close") < gate.calls.index("r0:open")
        with anyio.fail_after(5):
            while not all(s.core.gate_open for s in services.values()):
                await anyio.sleep(0.01)

        # 2. The next transition commits from the unchanged baseline, bit-exact.
        gate.calls.clear()
        ended = await transition(v1)
        assert ended.outcome is TransitionOutcome.COMMITTED and ended.modes == [Mode.MIXED]
        assert ended.xor_entries > 0
        assert ended.record.version == 1 and (await store.read()).record == ended.record
        _assert_hold(ranks, cfg, v1)
        for name in services:
            calls = [c.split(":")[1] for c in gate.calls if c.startswith(f"{name}:")]
            # KV caches are invalidated before the gate reopens (paper App. B.2).
            assert calls == ["close", "invalidate", "open"], (name, calls)

        # 3. And once more in overwrite mode (absolute values only).
        v2 = perturb(v1, rate=0.01, seed=2)
        ended = await transition(v2, mode=Mode.OVERWRITE)
        assert ended.outcome is TransitionOutcome.COMMITTED and ended.record.version == 2
        assert ended.modes == [Mode.OVERWRITE] and ended.xor_entries == 0
        _assert_hold(ranks, cfg, v2)


@pytest.mark.asyncio
async def test_embedded_in_asyncio(tmp_path: Path) -> None:
    await _fleet(tmp_path)  # the caller's own event loop: no anyio.run anywhere


def test_embedded_in_uvloop(tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        loop = runner.get_loop()
        assert type(loop).__module__.startswith("uvloop")
        runner.run(_fleet(tmp_path))
