"""The loader classification through the engines: a receiver reports what its loader refuses
(``EndpointStatus.xor_refused``), checks every prepare's bound set against its own
classification (``classification``), and owners encode exactly the bound set as overwrites
and every other changed tensor relative, whatever their integration setup's ``xor_names``.

The serving rank is the sharded serving model, whose final norm is stored in float32: a
transforming loader path (a cast on copy) that must never take a relative entry.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
import torch

from dcr.adapters.commit import SqliteCommitStore
from dcr.adapters.control import MemoryControl
from dcr.adapters.loaders.sharded import ShardedServingLoader, ShardedServingModel
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
from dcr.fleet.model import digests
from dcr.models.families import canonical_shapes, random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol import messages as msg
from dcr.protocol.types import AttemptInfo, CommitRecord, Mode, PayloadKey, Timeouts
from dcr.tensors.records import Encoding, TensorSpec
from dcr.wire.payload import decode_payload

pytestmark = pytest.mark.anyio

FAMILY = "llama"
NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
CONFIG = tiny_config(FAMILY)
CATALOG = {
    n: TensorSpec(name=n, shape=s, dtype=torch.bfloat16)
    for n, s in canonical_shapes(CONFIG, FAMILY).items()
}
TIMEOUTS = Timeouts(prepare_s=10, arrival_s=10, gate_s=20, flush_s=20, commit_s=5, stop_s=20)
BASE = CommitRecord(version=0, candidate="g0")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _state(seed: int) -> dict[str, torch.Tensor]:
    state = random_state_dict(CONFIG, FAMILY, seed=seed)
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


def _rank(state: dict[str, torch.Tensor] | None = None) -> Applier:
    """A prewarmed sharded rank (TP 1), empty or holding ``state``."""
    if state is None:
        loader = ShardedServingLoader(ShardedServingModel(CONFIG, FAMILY))
    else:
        loader = ShardedServingLoader.dense(CONFIG, FAMILY, state)
    receiver = Applier(loader, CATALOG)
    receiver.prewarm()
    return receiver


def _setup(xor_names: frozenset[str] = frozenset()) -> Integration:
    return Integration(catalog=CATALOG, xor_names=xor_names, owner_ids={"o0": 0})


# -- the receiver engine ----------------------------------------------------------------------


CASES = [
    # (mode, the prepare's xor_refused, the setup's xor_names, the receiver's answer)
    (Mode.MIXED, frozenset({NORM}), frozenset(), None),
    (Mode.MIXED, frozenset({NORM, Q, "not.in.the.catalog"}), frozenset(), None),
    (Mode.MIXED, frozenset(), frozenset(), "classification"),  # lets the norm through
    (Mode.MIXED, frozenset({Q}), frozenset(), "classification"),
    (Mode.MIXED, None, frozenset(set(CATALOG) - {NORM}), None),  # no set: the setup decides
    (Mode.MIXED, None, frozenset(CATALOG), "classification"),
    (Mode.MIXED, frozenset({NORM}), frozenset(CATALOG), None),  # the bound set wins
    (Mode.OVERWRITE, frozenset(), frozenset(CATALOG), None),  # nothing travels relative
]


@pytest.mark.parametrize(("mode", "refused", "xor_names", "rejection"), CASES)
async def test_a_receiver_rejects_a_prepare_that_lets_through_a_name_it_refuses(
    mode: Mode, refused: frozenset[str] | None, xor_names: frozenset[str], rejection: str | None
) -> None:
    receiver = _rank()
    control = MemoryControl()
    served = open_receiver(
        name="r0", receiver=receiver, integration=_setup(xor_names), control=control,
        transport=MemoryTransport(), held=BASE,
    )  # fmt: skip
    coordinator = await control.coordinator()
    info = AttemptInfo(
        attempt=1, candidate="g1", base=BASE, mode=mode, sync=True, coordinator=1,
        owners=("o0",), receivers=frozenset({"r0"}),
    )  # fmt: skip
    async with served as service:
        # What its status reports: the names its loader path does not preserve.
        assert service.refused() == frozenset({NORM})
        assert service.link is not None and service.link.status is not None
        assert service.link.status.xor_refused == frozenset({NORM})
        await coordinator.call("r0", msg.Prepare(info=info, xor_refused=refused), epoch=1)
        replies = coordinator.replies()
        try:
            with anyio.fail_after(10):
                async for reply in replies:
                    if isinstance(reply, msg.PrepareAccepted | msg.PrepareRejected):
                        break
        finally:
            await replies.aclose()  # type: ignore[attr-defined]
            await coordinator.aclose()
    if rejection is None:
        assert isinstance(reply, msg.PrepareAccepted), reply
    else:
        assert isinstance(reply, msg.PrepareRejected), reply
        assert reply.check == rejection


async def test_a_receiver_not_prewarmed_reports_no_classification() -> None:
    receiver = Applier(ShardedServingLoader(ShardedServingModel(CONFIG, FAMILY)), CATALOG)
    async with open_receiver(
        name="r0", receiver=receiver, integration=_setup(), control=MemoryControl(),
        transport=MemoryTransport(), held=BASE,
    ) as service:  # fmt: skip
        assert service.refused() is None
        assert service.link is not None and service.link.status is not None
        assert service.link.status.xor_refused is None


# -- owners encode what the prepare binds ------------------------------------------------------


class _LoggedSide(TrainingSide):
    """Logs each construction the group starts (with the names it may encode relative) and
    each attempt's first ask for a stream."""

    def __init__(self, group: LocalTrainingGroup) -> None:
        super().__init__(group, frozenset())  # the fallback: overwrites only
        self.log: list[str] = []
        self.allowed: list[Container[str]] = []
        self._asked: set[int] = set()
        build = group.build

        def logged(*, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
            self.log.append(f"build {mode.value}")
            self.allowed.append(xor_allowed)
            return build(mode=mode, xor_allowed=xor_allowed)

        group.build = logged  # type: ignore[method-assign,assignment]

    def stream(
        self, attempt: int, mode: Mode, rank: int, *, xor_refused: frozenset[str] | None = None
    ) -> Iterator[Bucket]:
        if attempt not in self._asked:
            self._asked.add(attempt)
            self.log.append("attempt asks")
        return super().stream(attempt, mode, rank, xor_refused=xor_refused)


class _Recorded(MemoryTransport):
    """The in-memory transport, keeping every attempt payload an owner sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[PayloadKey, bytes]] = []

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        if to is None:
            self.sent.append((key, bytes(data)))
        await super().send(key, data, to=to)


def _encodings(payloads: list[bytes]) -> dict[str, set[Encoding]]:
    out: dict[str, set[Encoding]] = {}
    for data in payloads:
        for item in decode_payload(data, catalog=CATALOG).items:
            out.setdefault(item.name, set()).add(item.encoding)
    return out


async def test_owners_encode_the_receivers_refused_set_as_overwrites(tmp_path: Path) -> None:
    """Two refits: the receiver's reported set reaches the owner through each prepare; the
    norm travels as overwrites, every other changed tensor relative, bit-exact; the build
    ahead of the first refit (made with no set yet) is rebuilt, the second one's is taken."""
    states = [_state(5)]
    for step in (1, 2):
        states.append(perturb(states[-1], rate=0.05, seed=step))
    source = StateDictSource(states[0], family=FAMILY, config=CONFIG)
    side = _LoggedSide(LocalTrainingGroup(source.plan, source.base_shards()))
    setup = _setup()  # xor_names = frozenset(): without the reports, nothing goes relative
    store = SqliteCommitStore(tmp_path / "commit.db")
    control, transport = MemoryControl(), _Recorded()
    base = (await store.read()).record
    owned = open_owner(
        name="o0", rank=0, side=side, integration=setup, control=control, transport=transport,
        store=store, baseline=base,
    )  # fmt: skip
    receiver = _rank(states[0])
    served = open_receiver(
        name="r0", receiver=receiver, integration=setup, control=control, transport=transport,
        held=base,
    )  # fmt: skip
    async with AsyncExitStack() as stack:
        owner = await stack.enter_async_context(owned)
        service = await stack.enter_async_context(served)
        assert service.link is not None and service.link.status is not None
        reports = {"r0": service.link.status.xor_refused}
        assert reports == {"r0": frozenset({NORM})}
        for version in (1, 2):
            side.log.clear()
            transport.sent.clear()
            coordinator = await stack.enter_async_context(
                open_coordinator(
                    owners=setup.owner_ids, receivers=["r0"], store=store, control=control,
                    transport=transport, timeouts=TIMEOUTS, xor_refused=reports,
                )
            )  # fmt: skip
            published: list[CommitRecord] = []

            async def publish(
                state: dict[str, torch.Tensor], published: list[CommitRecord] = published
            ) -> None:
                published.append(await owner.publish(source.candidate_shards(state)))

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(publish, states[version])
                    while not side.log:  # the build ahead started before the prepare
                        await anyio.sleep(0.01)
                    tg.start_soon(coordinator.run)
            assert [r.version for r in published] == [version]
            got = _encodings([data for _, data in transport.sent])
            assert got[NORM] == {Encoding.OVERWRITE}
            others = {n: e for n, e in got.items() if n != NORM}
            assert len(others) > 10 and all(Encoding.OVERWRITE not in e for e in others.values())
            relative = frozenset(CATALOG) - {NORM}
            if version == 1:
                # Built ahead with no set yet (the fallback: overwrites only), then rebuilt.
                assert side.log == ["build mixed", "attempt asks", "build mixed"]
                assert [set(a) for a in side.allowed[-2:]] == [set(), relative]  # type: ignore[call-overload]
            else:
                assert side.log == ["build mixed", "attempt asks"]  # the last prepare's set
                assert set(side.allowed[-1]) == relative  # type: ignore[call-overload]
            expected = ShardedServingLoader.dense(CONFIG, FAMILY, states[version])
            assert digests(receiver.loader.module) == digests(expected.module)
