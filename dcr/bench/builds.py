"""The builds the construct and apply benchmarks compare, encoded as owners encode them.

For one staged version a training group builds a *sparse* refit (changed elements only), an
*adaptive* one (:attr:`~dcr.delta.build.BuildConfig.dense_above`: a tensor changed at least
that much goes dense, :func:`adaptive_build`), or the *dense* build of its committed version
(every element, what a joining receiver gets; ``dense=True`` of :func:`build_streams`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterator
from contextlib import contextmanager

from dcr.delta.build import Bucket, BuildConfig
from dcr.delta.group import BucketStreams, LocalTrainingGroup
from dcr.tensors.records import Mode
from dcr.wire.encode import encode_bucket
from dcr.wire.format import ValueLayout

__all__ = ["adaptive_build", "build_streams", "encode_payload"]


@contextmanager
def adaptive_build(group: LocalTrainingGroup, above: float | None) -> Iterator[None]:
    """Builds of ``group`` inside the block use ``dense_above = above``; the group's own
    setting is back afterwards."""
    before = group.config

    def use(config: BuildConfig) -> None:
        group.config = config
        for owner in group.owners.values():
            owner.config = config

    use(dataclasses.replace(before, dense_above=above))
    try:
        yield
    finally:
        use(before)


def build_streams(
    group: LocalTrainingGroup,
    *,
    mode: Mode = Mode.MIXED,
    xor_allowed: Container[str] = frozenset(),
    full_conversion: bool = False,
    dense: bool = False,
) -> BucketStreams:
    """Per owner, the buckets of the staged version (``dense``: every element of the
    committed version, ``mode`` and the rest ignored) and the stats they fill."""
    if dense:
        return group.build_dense()
    return group.build(mode=mode, xor_allowed=xor_allowed, full_conversion=full_conversion)


def encode_payload(bucket: Bucket, *, owner: int, payload_id: int, attempt: int) -> bytes:
    """One bucket as the payload an owner sends (byte-planed values, as the fleet's)."""
    return encode_bucket(
        items=bucket.items,
        attempt=attempt,
        owner=owner,
        payload_id=payload_id,
        final=bucket.final,
        layout=ValueLayout.BYTEPLANE,
    )
