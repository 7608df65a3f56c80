"""Owners and receivers must hold one catalog; when they do not, both sides say so clearly.

An owner refuses, at construction, a training side whose catalog is not the integration's.
A receiver serving another checkpoint than the owners' (here its final norm is float16 where
the trainer's is bfloat16) refuses their payloads at admission, and the attempt's failure
names the tensor and the dtypes that differ instead of a bare check name.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
import torch

from dcr import TorchModuleLoader
from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.control import MemoryControl
from dcr.adapters.control.base import EndpointLink
from dcr.adapters.sources import StateDictSource
from dcr.adapters.transport import MemoryTransport
from dcr.apply.applier import Applier
from dcr.delta.group import LocalTrainingGroup
from dcr.engine import (
    Integration,
    OwnerService,
    TrainingSide,
    open_coordinator,
    open_owner,
    open_receiver,
)
from dcr.errors import ConfigError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.modules import module_from_state_dict
from dcr.models.updates import perturb
from dcr.protocol import messages as msg
from dcr.protocol.types import Timeouts
from dcr.tensors.records import TensorSpec

pytestmark = pytest.mark.anyio

FAMILY = "qwen3"
NORM = "model.norm.weight"


class RecordingControl(MemoryControl):
    """The in-memory control channel, keeping every reply endpoints send."""

    def __init__(self) -> None:
        super().__init__()
        self.replies: list[msg.Reply] = []

    async def endpoint(self, name: str) -> EndpointLink:
        link = await super().endpoint(name)
        notify = link.notify

        async def recorded(reply: msg.Reply) -> None:
            self.replies.append(reply)
            await notify(reply)

        link.notify = recorded  # type: ignore[method-assign]
        return link


def _catalog(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {n: TensorSpec.of(n, t) for n, t in state.items()}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_receiver_of_another_checkpoint_names_what_differs(tmp_path: Path) -> None:
    config = tiny_config(FAMILY)
    trained = random_state_dict(config, FAMILY, seed=5)
    served = {**trained, NORM: trained[NORM].to(torch.float16)}
    source = StateDictSource(trained, family=FAMILY, config=config)
    group = LocalTrainingGroup(source.plan, source.base_shards())
    owners = {"o0": 0}
    trainer_setup = Integration(catalog=source.catalog, xor_names=frozenset(), owner_ids=owners)
    serving_setup = Integration(catalog=_catalog(served), xor_names=frozenset(), owner_ids=owners)
    store = SqliteCommitStore(tmp_path / "commit.db")
    control, transport = RecordingControl(), MemoryTransport()
    base = (await store.read()).record
    side = TrainingSide(group, frozenset())

    def owner(integration: Integration) -> dict[str, object]:
        return dict(
            name="o0", rank=0, side=side, integration=integration, control=control,
            transport=transport, store=store, baseline=base,
        )  # fmt: skip

    # The owner checks its training side against the catalog receivers admit.
    with pytest.raises(ConfigError, match="differs from the catalog of the integration") as info:
        OwnerService(**owner(serving_setup))  # type: ignore[arg-type]
    assert (info.value.check, info.value.tensor) == ("catalog", NORM)
    assert f"{NORM}: bfloat16 [64] instead of float16 [64]" in str(info.value)

    receiver = Applier(TorchModuleLoader(module_from_state_dict(served)), serving_setup.catalog)
    receiver.prewarm()
    service = dict(
        name="r0", receiver=receiver, integration=serving_setup, control=control,
        transport=transport, held=base,
    )  # fmt: skip
    timeouts = Timeouts(prepare_s=5, arrival_s=5, gate_s=10, flush_s=10, commit_s=2, stop_s=10)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(open_owner(**owner(trainer_setup)))
        await stack.enter_async_context(open_receiver(**service))
        group.stage(source.candidate_shards(perturb(trained, rate=0.2, seed=1)))
        coordinator = await stack.enter_async_context(
            open_coordinator(
                owners=owners,
                receivers=["r0"],
                store=store,
                control=control,
                transport=transport,
                timeouts=timeouts,
            )
        )
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(coordinator.run)
                while not any(isinstance(r, msg.AttemptFailed) for r in control.replies):
                    await anyio.sleep(0.01)
                await coordinator.abort("the catalogs differ")
    failed = next(r for r in control.replies if isinstance(r, msg.AttemptFailed))
    assert failed.check == "dtype"
    assert "the owners' catalog differs from this receiver's" in failed.message
    assert f"tensor={NORM!r}" in failed.message and "float16" in failed.message
    # Nothing of the refused payload landed.
    norm = receiver.loader.module.get_parameter(NORM)
    assert torch.equal(norm.detach().view(torch.int16), served[NORM].view(torch.int16))
