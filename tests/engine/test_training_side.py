"""TrainingSide: an attempt's bucket iterators, letting go of a stopped one, and the first
bucket built ahead of the prepare."""

from __future__ import annotations

import threading
import time
from collections.abc import Container, Iterator

import pytest

from dcr.adapters.sources import StateDictSource
from dcr.delta.build import Bucket, BuildConfig
from dcr.delta.group import BucketStreams, LocalTrainingGroup
from dcr.engine import TrainingSide
from dcr.errors import LayoutError
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.updates import perturb
from dcr.protocol.types import Mode
from dcr.tensors.records import Encoding

FAMILY = "llama"


def _side(bucket_bytes: int = 1 << 12) -> TrainingSide:
    config = tiny_config(FAMILY)
    base = random_state_dict(config, FAMILY, seed=3)
    source = StateDictSource(base, family=FAMILY, config=config)
    # Tiny chunks and buckets: the attempt takes several buckets.
    build = BuildConfig(chunk_bytes=1 << 12, bucket_bytes=bucket_bytes, threads=2)
    group = LocalTrainingGroup(source.plan, source.base_shards(), config=build)
    new = perturb(base, rate=0.05, seed=4)
    group.stage(source.plan.slice(new))
    return TrainingSide(group, frozenset())


def test_closing_a_stopped_attempts_iterator_ends_it_and_keeps_its_stats() -> None:
    side = _side()
    buckets = side.stream(7, Mode.MIXED, 0)
    first = next(buckets)
    assert not first.final and first.items  # more buckets follow
    read = side.stats(7).source_bytes
    assert read > 0
    side.close(7, 0)
    assert next(buckets, None) is None  # ended where it stood: no further bucket
    assert side.stats(7).source_bytes == read
    side.close(7, 0)  # repeated: harmless
    side.close(8, 0)  # an attempt it never built: harmless


def test_closing_an_iterator_that_ran_to_its_end_changes_nothing() -> None:
    side = _side(bucket_bytes=1 << 30)
    buckets = list(side.stream(7, Mode.MIXED, 0))
    assert buckets[-1].final
    changed = side.stats(7).changed_elements
    side.close(7, 0)
    assert side.stats(7).changed_elements == changed > 0


# -- building the first bucket ahead of the prepare --------------------------------------------


def _contents(buckets: list[Bucket]) -> list[tuple[bool, list[tuple[str, int, bytes, bytes]]]]:
    """Every bucket's items as bytes: equal contents, equal bits."""
    return [
        (
            b.final,
            [(i.name, int(i.encoding), i.indices.tobytes(), i.values.tobytes()) for i in b.items],
        )
        for b in buckets
    ]


def _counting(side: TrainingSide) -> list[Mode]:
    """The modes of every ``group.build`` the side starts, in order."""
    builds: list[Mode] = []
    inner = side.group.build

    def build(*, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
        builds.append(mode)
        return inner(mode=mode, xor_allowed=xor_allowed)

    side.group.build = build  # type: ignore[method-assign]
    return builds


@pytest.mark.parametrize("mode", [Mode.MIXED, Mode.OVERWRITE])
def test_an_attempt_in_the_predicted_mode_takes_the_buckets_built_ahead(mode: Mode) -> None:
    reference = _contents(list(_side().stream(1, mode, 0)))
    side = _side()
    builds = _counting(side)
    side.build_ahead(mode, 0)
    assert builds == [mode]
    side.build_ahead(mode, 0)  # asked again (another owner of the process): no second build
    assert builds == [mode]
    got = _contents(list(side.stream(7, mode, 0)))
    assert builds == [mode]  # the attempt built nothing afresh
    assert got == reference and len(got) > 1
    assert side.stats(7).changed_elements > 0
    side.build_ahead(mode, 0)  # the candidate is an attempt's now: nothing more ahead
    assert builds == [mode]


def test_an_attempt_in_another_mode_builds_afresh_and_ends_the_build_ahead() -> None:
    reference = _contents(list(_side().stream(1, Mode.OVERWRITE, 0)))
    side = _side()
    builds = _counting(side)
    side.build_ahead(Mode.MIXED, 0)
    got = _contents(list(side.stream(7, Mode.OVERWRITE, 0)))
    assert builds == [Mode.MIXED, Mode.OVERWRITE]
    assert got == reference
    assert all(enc == int(Encoding.OVERWRITE) for _, items in got for _, enc, _, _ in items)


def test_a_candidate_staged_again_is_not_served_from_the_old_build_ahead() -> None:
    side = _side()
    builds = _counting(side)
    side.build_ahead(Mode.MIXED, 0)
    side.forget_ahead()  # the owner engine does this whenever the trainer stages or drops
    list(side.stream(7, Mode.MIXED, 0))
    assert builds == [Mode.MIXED, Mode.MIXED]
    side.group.discard()
    side.forget_ahead()
    side.build_ahead(Mode.MIXED, 0)  # nothing staged: nothing to build
    assert builds == [Mode.MIXED, Mode.MIXED]


def test_the_attempt_and_a_concurrent_build_ahead_build_the_first_bucket_once() -> None:
    reference = _contents(list(_side().stream(1, Mode.MIXED, 0)))
    for delay in (0.0, 0.001, 0.01, 0.05):
        side = _side()
        builds = _counting(side)
        thread = threading.Thread(target=side.build_ahead, args=(Mode.MIXED, 0))
        thread.start()  # the worker building ahead, and the prepare arriving meanwhile
        time.sleep(delay)
        got = _contents(list(side.stream(7, Mode.MIXED, 0)))
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert got == reference, delay
        assert builds == [Mode.MIXED], delay


def test_a_failure_of_the_build_ahead_surfaces_in_the_attempt() -> None:
    side = _side()
    inner = side.group.build

    def build(*, mode: Mode, xor_allowed: Container[str]) -> BucketStreams:
        streams = inner(mode=mode, xor_allowed=xor_allowed)

        def failing() -> Iterator[Bucket]:
            raise LayoutError("shard is gone", tensor="x")
            yield  # pragma: no cover

        return {r: (failing(), st) for r, (_, st) in streams.items()}

    side.group.build = build  # type: ignore[method-assign]
    side.build_ahead(Mode.MIXED, 0)  # does not raise: the failure is the attempt's
    with pytest.raises(LayoutError, match="shard is gone"):
        next(side.stream(7, Mode.MIXED, 0))


# -- what travels relative: the prepare's refused set -------------------------------------------

NORM = "model.norm.weight"
QKV = "model.layers.0.self_attn.q_proj.weight"


def _encodings(buckets: list[Bucket]) -> dict[str, set[Encoding]]:
    """Tensor name -> the encodings of its entries in ``buckets``."""
    out: dict[str, set[Encoding]] = {}
    for b in buckets:
        for i in b.items:
            out.setdefault(i.name, set()).add(i.encoding)
    return out


def test_mixed_mode_encodes_refused_names_as_overwrites_and_the_others_relative() -> None:
    side = _side()
    refused = frozenset({NORM, QKV, "not.in.the.catalog"})
    got = _encodings(list(side.stream(7, Mode.MIXED, 0, xor_refused=refused)))
    assert NORM in got and QKV in got and len(got) > 2  # the step changed them all
    for name, encodings in got.items():
        if name in refused:
            assert encodings == {Encoding.OVERWRITE}, name
        else:
            assert encodings and Encoding.OVERWRITE not in encodings, (name, encodings)
    # Nothing refused: every tensor relative (the plan's projections all preserve bits).
    everything = _encodings(list(_side().stream(7, Mode.MIXED, 0, xor_refused=frozenset())))
    assert everything.keys() == got.keys()
    assert all(Encoding.OVERWRITE not in e for e in everything.values())
    # No set bound: the side's fallback (here, frozenset(): overwrites only).
    fallback = _encodings(list(_side().stream(7, Mode.MIXED, 0)))
    assert all(e == {Encoding.OVERWRITE} for e in fallback.values())
    # Overwrite mode ignores the set.
    plain = _encodings(list(_side().stream(7, Mode.OVERWRITE, 0, xor_refused=frozenset())))
    assert all(e == {Encoding.OVERWRITE} for e in plain.values())


def test_a_build_ahead_with_another_refused_set_is_rebuilt() -> None:
    refused = frozenset({NORM})
    reference = _contents(list(_side().stream(1, Mode.MIXED, 0, xor_refused=refused)))
    for ahead in (None, frozenset(), frozenset({QKV})):
        side = _side()
        builds = _counting(side)
        side.build_ahead(Mode.MIXED, 0, xor_refused=ahead)
        got = _contents(list(side.stream(7, Mode.MIXED, 0, xor_refused=refused)))
        assert builds == [Mode.MIXED, Mode.MIXED], ahead  # built again, with the prepare's set
        assert got == reference, ahead
    # The same set (an equal one, not the same object): taken over.
    side = _side()
    builds = _counting(side)
    side.build_ahead(Mode.MIXED, 0, xor_refused=frozenset([NORM]))
    assert _contents(list(side.stream(7, Mode.MIXED, 0, xor_refused=refused))) == reference
    assert builds == [Mode.MIXED]
    # Overwrite mode encodes nothing relative: any set serves it.
    side = _side()
    builds = _counting(side)
    side.build_ahead(Mode.OVERWRITE, 0, xor_refused=refused)
    list(side.stream(7, Mode.OVERWRITE, 0, xor_refused=None))
    assert builds == [Mode.OVERWRITE]
