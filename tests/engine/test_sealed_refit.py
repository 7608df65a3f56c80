"""Sealed payloads through the real engines (``LocalRefit`` over ``LocalCluster``): with a fleet
secret every payload on the wire carries a keyed seal, a refit is bit-exact, and a payload a
host on the path forges or replays is refused by the receivers' reception checks -- counted,
failing the attempt, never applied -- while the overwrite retry commits the genuine version."""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping

import blake3
import pytest
import torch

from dcr import LocalRefit, StateDictSource, TrainLayout
from dcr.adapters.faulty import Faults
from dcr.adapters.loaders.sharded import ShardedServingLoader
from dcr.adapters.transport.base import Transport, TransportWrapper
from dcr.adapters.transport.memory import MemoryTransport
from dcr.delta.build import BuildConfig
from dcr.errors import PayloadRejected
from dcr.local import DataPlane, RefitConfig
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol.types import PayloadKey
from dcr.tensors.records import Item
from dcr.wire.decode import decode_payload, read_header
from dcr.wire.encode import encode_payload
from dcr.wire.format import FLAG_KEYED
from dcr.wire.seal import seal_keys

SECRET = bytes(range(32))
KP = seal_keys(SECRET).payload
SMALL = BuildConfig(chunk_bytes=4096, bucket_bytes=8192)  # several payloads per owner
FAMILY = "qwen3"

Forge = Callable[[PayloadKey, bytes], bytes | None]


class PathAttacker(TransportWrapper):
    """A host between the owners and the receivers: it sees every payload and may replace the
    first one ``forge`` returns other bytes for (it holds no fleet secret)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.sent: list[tuple[PayloadKey, bytes]] = []
        self.forge: Forge | None = None
        self.forged: list[PayloadKey] = []

    async def send(self, key: PayloadKey, data: bytes, *, to: frozenset[str] | None = None) -> None:
        self.sent.append((key, data))
        if self.forge is not None:
            other = self.forge(key, data)
            if other is not None:
                self.forge = None
                self.forged.append(key)
                data = other
        await self.inner.send(key, data, to=to)


def int16_views(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: t.detach().contiguous().reshape(-1).view(torch.int16).clone()
        for n, t in module.state_dict().items()
    }


def assert_exact(cfg: object, w: Mapping[str, torch.Tensor], ranks: list) -> None:
    fresh = [ShardedServingLoader.dense(cfg, FAMILY, w, tp_size=2, tp_rank=r) for r in range(2)]
    for i, (a, b) in enumerate(zip(ranks, fresh, strict=True)):
        got, want = int16_views(a.module), int16_views(b.module)
        assert got.keys() == want.keys()
        for name in want:
            assert (got[name] != want[name]).sum().item() == 0, f"rank {i}: {name}"


def setup(config: RefitConfig | None = None):
    cfg = tiny_config(FAMILY)
    w0 = random_state_dict(cfg, FAMILY, seed=0)
    ranks = [ShardedServingLoader.dense(cfg, FAMILY, w0, tp_size=2, tp_rank=r) for r in range(2)]
    source = StateDictSource(w0, layout=TrainLayout(tp=2, dp=2), family=FAMILY, config=cfg)
    attacker = PathAttacker(MemoryTransport())
    config = config or RefitConfig(build=SMALL, fleet_secret=SECRET)
    refit = LocalRefit(source, ranks, config=config, transport=attacker)
    applied: list[PayloadKey] = []
    for svc in refit.cluster.receiver_services.values():
        inner = svc.on_applied

        def on_applied(key: PayloadKey, inner: Callable[[PayloadKey], None] | None = inner) -> None:
            applied.append(key)
            if inner is not None:
                inner(key)

        svc.on_applied = on_applied
    return cfg, w0, ranks, refit, attacker, applied


def rejected(refit: LocalRefit) -> dict[str, int]:
    total: dict[str, int] = {}
    for svc in refit.cluster.receiver_services.values():
        for check, n in svc.rejected.items():
            total[check] = total.get(check, 0) + n
    return total


def other_values(data: bytes, key: bytes | None) -> bytes:
    """The payload's items with every value changed, sealed with ``key`` (``None``: a valid
    unkeyed BLAKE3 digest), as a forger who read the payload off the wire makes them: it
    clears the keyed bit and rewrites the digest to read the body, then re-encodes."""
    out = bytearray(data)
    (flags,) = struct.unpack_from("<H", out, 6)
    struct.pack_into("<H", out, 6, flags & ~FLAG_KEYED)
    out[56:72] = blake3.blake3(bytes(out[:56]) + bytes(out[72:])).digest()[:16]
    payload = decode_payload(bytes(out))
    items = [
        Item(
            name=it.name,
            shape=it.shape,
            dtype=it.dtype,
            encoding=it.encoding,
            indices=it.indices,
            span=it.span,
            values=it.values ^ 1,
        )
        for it in payload.items
    ]
    forged = encode_payload(payload.header, items, seal_key=key)
    assert forged != data
    return forged


def test_a_sealed_refit_is_bit_exact_and_every_payload_on_the_wire_carries_the_seal() -> None:
    cfg, w, ranks, refit, attacker, _ = setup()
    with refit:
        for v in (1, 2):
            w = perturb(w, rate=0.05, seed=v)
            report = refit.refit(w)
            assert [a.mode.value for a in report.attempts] == ["mixed"]
            assert_exact(cfg, w, ranks)
        assert rejected(refit) == {}
    assert len(attacker.sent) > 4
    for _, data in attacker.sent:
        assert struct.unpack_from("<H", data, 6)[0] & FLAG_KEYED
        read_header(data, seal_key=KP)
        with pytest.raises(PayloadRejected, match="fleet secret"):
            read_header(data)  # a receiver without the secret cannot verify them


@pytest.mark.parametrize(
    ("key", "check"),
    [(None, "unsealed"), (seal_keys(bytes(32)).payload, "digest")],
    ids=["unkeyed-blake3", "another-secret"],
)
def test_a_forged_payload_is_refused_counted_and_never_applied(
    key: bytes | None, check: str
) -> None:
    cfg, w, ranks, refit, attacker, applied = setup()
    with refit:
        attacker.forge = lambda k, data: other_values(data, key)
        w1 = perturb(w, rate=0.05, seed=1)
        report = refit.refit(w1)
        # the forgery failed the first attempt; the overwrite retry committed the genuine bits
        assert [a.mode.value for a in report.attempts] == ["mixed", "overwrite"]
        assert rejected(refit).get(check, 0) >= 1
        assert set(rejected(refit)) == {check}
        (forged,) = attacker.forged
        assert forged.attempt == report.attempts[0].attempt
        assert forged not in applied  # nothing of it was applied anywhere
        assert_exact(cfg, w1, ranks)


@pytest.mark.parametrize(
    ("relabel", "check"),
    [(False, "schema"), (True, "digest")],
    ids=["replayed-as-is", "relabelled"],
)
def test_a_replay_of_the_last_attempts_payload_is_refused(relabel: bool, check: str) -> None:
    """Replayed unchanged, attempt N's payload is sealed but names attempt N in its header:
    the receiver's key-against-header check refuses it (``schema``).  Relabelled as attempt
    N+1 it fails its seal (``digest``): the seal covers the attempt."""
    cfg, w, ranks, refit, attacker, applied = setup()
    with refit:
        w1 = perturb(w, rate=0.05, seed=1)
        first = refit.refit(w1).attempts[0].attempt
        old = {(k.owner, k.payload_id): d for k, d in attacker.sent if k.attempt == first}

        def replay(key: PayloadKey, data: bytes) -> bytes | None:
            previous = old.get((key.owner, key.payload_id))
            if previous is None or key.attempt == first:
                return None
            if not relabel:
                return previous
            out = bytearray(previous)
            struct.pack_into("<Q", out, 8, key.attempt)
            return bytes(out)

        attacker.forge = replay
        w2 = perturb(w1, rate=0.05, seed=2)
        report = refit.refit(w2)
        (forged,) = attacker.forged
        assert forged.attempt == report.attempts[0].attempt > first
        assert [a.mode.value for a in report.attempts] == ["mixed", "overwrite"]
        assert set(rejected(refit)) == {check}
        assert forged not in applied
        assert_exact(cfg, w2, ranks)


@pytest.mark.parametrize(
    "faults", [Faults(corrupt=1), Faults(conflicting=1)], ids=["corrupt", "conflicting"]
)
def test_faults_of_the_plan_recover_with_sealed_payloads(faults: Faults) -> None:
    """A flipped byte fails the seal (``digest``); a conflicting re-send is sealed like the
    original (the fault plan plays a confused owner, not a forger), so it fails the attempt as
    a conflicting duplicate, not as an unsealed payload."""
    cfg, w, ranks, refit, _, _ = setup()
    with refit:
        w1 = perturb(w, rate=0.05, seed=1)
        report = refit.refit(w1, faults=faults)
        assert [a.mode.value for a in report.attempts] == ["mixed", "overwrite"]
        if faults.corrupt:
            assert report.faults.corrupted == 1
            assert set(rejected(refit)) == {"digest"}
        else:
            assert report.faults.conflicting == 1
            assert rejected(refit) == {}
        assert_exact(cfg, w1, ranks)


def test_the_data_plane_seals_and_requires_its_fleet_secret() -> None:
    cfg = tiny_config(FAMILY)
    w0 = random_state_dict(cfg, FAMILY, seed=0)
    ranks = [ShardedServingLoader.dense(cfg, FAMILY, w0, tp_size=2, tp_rank=r) for r in range(2)]
    source = StateDictSource(w0, layout=TrainLayout(tp=2, dp=2), family=FAMILY, config=cfg)
    w1 = perturb(w0, rate=0.05, seed=1)
    with DataPlane(source, ranks, config=RefitConfig(build=SMALL, fleet_secret=SECRET)) as plane:
        payloads, _ = plane.build_payloads(w1)
        assert all(struct.unpack_from("<H", p, 6)[0] & FLAG_KEYED for p in payloads)
        others = [
            ShardedServingLoader.dense(cfg, FAMILY, w0, tp_size=2, tp_rank=r) for r in range(2)
        ]
        with DataPlane(source, others, config=RefitConfig(build=SMALL)) as unkeyed:
            with pytest.raises(PayloadRejected, match="fleet secret"):
                unkeyed.apply_payloads(payloads)
            plain, _ = unkeyed.build_payloads(w1)
        with pytest.raises(PayloadRejected) as err:
            plane.apply_payloads(plain)
        assert err.value.check == "unsealed"
        plane.apply_payloads(payloads)
        plane.commit()
    assert_exact(cfg, w1, ranks)
