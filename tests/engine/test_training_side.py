"""TrainingSide: an attempt's bucket iterators, and letting go of a stopped one."""

from __future__ import annotations

from dcr.adapters.sources import StateDictSource
from dcr.delta.group import LocalTrainingGroup
from dcr.delta.owner import BuildConfig
from dcr.engine import TrainingSide
from dcr.protocol.types import Mode
from dcr.testing.models import random_state_dict, tiny_config
from dcr.testing.updates import perturb

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
