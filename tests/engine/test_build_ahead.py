"""``OwnerService.publish`` builds the first bucket before the prepare arrives, and the attempt
takes it over: one build, started before the attempt asked for its stream, and a bit-exact
commit.  With ``build_ahead=False`` the attempt starts the only build itself."""

from __future__ import annotations

from collections.abc import Container, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from dcr import TorchModuleLoader
from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.control import MemoryControl
from dcr.adapters.sources import StateDictSource
from dcr.adapters.transport import MemoryTransport
from dcr.apply.applier import Applier
from dcr.delta.build import Bucket
from dcr.delta.group import BucketStreams, LocalTrainingGroup
from dcr.engine import (
    Integration,
    TrainingSide,
    open_coordinator,
    open_owner,
    open_receiver,
)
from dcr.models.compare import module_bit_mismatches
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import perturb
from dcr.protocol.types import Mode, Timeouts

pytestmark = pytest.mark.anyio

FAMILY = "qwen3"
TIMEOUTS = Timeouts(prepare_s=10, arrival_s=10, gate_s=20, flush_s=20, commit_s=5, stop_s=20)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _LoggedSide(TrainingSide):
    """A training side that logs, in order, each attempt's first ask for a stream and each
    construction the group starts."""

    def __init__(self, group: LocalTrainingGroup) -> None:
        super().__init__(group, frozenset())
        self.log: list[str] = []
        self._asked: set[int] = set()
        build = group.build

        def logged(*, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
            self.log.append(f"build {mode.value}")
            return build(mode=mode, xor_allowed=xor_allowed)

        group.build = logged  # type: ignore[method-assign,assignment]

    def stream(
        self, attempt: int, mode: Mode, rank: int, *, xor_refused: frozenset[str] | None = None
    ) -> Iterator[Bucket]:
        if attempt not in self._asked:
            self._asked.add(attempt)
            self.log.append("attempt asks")
        return super().stream(attempt, mode, rank, xor_refused=xor_refused)


@pytest.mark.parametrize(("ahead", "log"), [
    (True, ["build mixed", "attempt asks"]),
    (False, ["attempt asks", "build mixed"]),
])  # fmt: skip
async def test_publish_builds_the_first_bucket_before_the_attempt_asks(
    tmp_path: Path, ahead: bool, log: list[str]
) -> None:
    config = tiny_config(FAMILY)
    trained = random_state_dict(config, FAMILY, seed=5)
    source = StateDictSource(trained, family=FAMILY, config=config)
    side = _LoggedSide(LocalTrainingGroup(source.plan, source.base_shards()))
    setup = Integration(catalog=source.catalog, xor_names=frozenset(), owner_ids={"o0": 0})
    store = SqliteCommitStore(tmp_path / "commit.db")
    control, transport = MemoryControl(), MemoryTransport()
    base = (await store.read()).record
    owner_options = dict(
        name="o0", rank=0, side=side, integration=setup, control=control, transport=transport,
        store=store, baseline=base, build_ahead=ahead,
    )  # fmt: skip
    module = module_from_state_dict(trained)
    receiver = Applier(TorchModuleLoader(module), setup.catalog)
    receiver.prewarm()
    receiver_options = dict(
        name="r0", receiver=receiver, integration=setup, control=control, transport=transport,
        held=base,
    )  # fmt: skip
    new = perturb(trained, rate=0.05, seed=1)
    async with AsyncExitStack() as stack:
        owner = await stack.enter_async_context(open_owner(**owner_options))
        await stack.enter_async_context(open_receiver(**receiver_options))
        coordinator = await stack.enter_async_context(
            open_coordinator(
                owners=setup.owner_ids, receivers=["r0"], store=store, control=control,
                transport=transport, timeouts=TIMEOUTS,
            )
        )  # fmt: skip
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(coordinator.run)
                record = await owner.publish(source.candidate_shards(new))
    assert record.version == 1 and (await store.read()).record == record
    assert side.log == log  # one construction, which the attempt took over when built ahead
    assert module_bit_mismatches(module, module_from_state_dict(new)) == []
