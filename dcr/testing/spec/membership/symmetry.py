"""State normalization for the search of ``models/membership.tla``: receivers are
interchangeable, and a ``seen`` epoch matters only through its comparisons with the epochs
still in play, so states that differ only there behave alike and are stored once."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

from dcr.testing.spec.membership.state import (
    Commit,
    DenseCall,
    Ready,
    Receiver,
    Registered,
    Reopen,
    Run,
    State,
)
from dcr.testing.spec.memo import memo

__all__ = ["canonical", "canonical_order", "normalize_seen", "renumber"]


def normalize_seen(s: State) -> State:
    """Each receiver's ``seen`` moved to the lowest value ranked alike among the epochs in play.

    ``seen`` is compared only with epochs in play -- the lease, the run's epoch and the epochs
    of calls in flight -- and with newer epochs, which are at least the lease.  A ``seen`` in
    play stays; one strictly between two epochs in play becomes one above the lower, so every
    comparison (strict or not) comes out the same.
    """
    run_epoch = None if s.run is None else s.run.epoch
    play = memo(
        ("play", s.lease, run_epoch, s.to_receivers, s.reopens),
        partial(_in_play, s.lease, run_epoch, s.to_receivers, s.reopens),
    )
    if all(rx.seen in play for rx in s.receivers):
        return s

    def rank(seen: int) -> int:
        return seen if seen in play else max(e for e in play if e < seen) + 1

    receivers = tuple(rx._replace(seen=rank(rx.seen)) for rx in s.receivers)
    return s.evolve(receivers=receivers)


def _in_play(
    lease: int, run_epoch: int | None, calls: frozenset[DenseCall], reopens: frozenset[Reopen]
) -> frozenset[int]:
    """The epochs a receiver's ``seen`` is compared with."""
    play = {0, lease} if run_epoch is None else {0, lease, run_epoch}
    return frozenset(play | {c.epoch for c in calls} | {c.epoch for c in reopens})


def _opt(x: tuple[int | bool, ...] | None) -> tuple[int | bool, ...]:
    return () if x is None else (1, *x)


def _per_receiver(n: int, pairs: Iterable[tuple[int, Any]]) -> tuple[tuple[Any, ...], ...]:
    """Per receiver: the sorted values of the ``(receiver, value)`` pairs naming it."""
    out: list[list[Any]] = [[] for _ in range(n)]
    for r, value in pairs:
        out[r].append(value)
    return tuple(tuple(sorted(x)) for x in out)


def _calls(calls: frozenset[DenseCall] | frozenset[Reopen], n: int) -> tuple[Any, ...]:
    return _per_receiver(n, ((c.receiver, (c.job, c.record, c.epoch)) for c in calls))


def _readies(readies: frozenset[Ready], n: int) -> tuple[Any, ...]:
    return _per_receiver(n, ((m.receiver, (m.inc, m.job, m.record)) for m in readies))


def _missing(commits: tuple[Commit, ...], n: int) -> tuple[Any, ...]:
    per_commit = [_per_receiver(n, c.missing) for c in commits]
    return tuple(tuple(m[r] for m in per_commit) for r in range(n))


def _own(rx: Receiver) -> tuple[object, ...]:
    return (
        rx.phase.value, rx.inc, rx.storage, rx.held, rx.dirty, rx.gate, rx.seen,
        _opt(rx.dense), rx.acked, rx.foreign,
    )  # fmt: skip


def _keys(s: State) -> list[tuple[object, ...]]:
    """Per receiver: everything that concerns it, for the canonical order (each part of the
    state is read once, not once per receiver, and memoized per distinct value)."""
    n = len(s.receivers)
    run = s.run
    core = s.core
    # One tag per kind of part: named tuples of other kinds may compare equal as tuples.
    calls = memo(("to_receivers", s.to_receivers, n), partial(_calls, s.to_receivers, n))
    reopens = memo(("reopens", s.reopens, n), partial(_calls, s.reopens, n))
    readies = memo(("readies", s.readies, n), partial(_readies, s.readies, n))
    missing = memo(("missing", s.commits, n), partial(_missing, s.commits, n))
    bound = (
        () if run is None else memo(("bound", run.bound, n), partial(_per_receiver, n, run.bound))
    )
    registered = s.registered
    keys: list[tuple[object, ...]] = []
    for r, rx in enumerate(s.receivers):
        keys.append(
            (
                memo(("own", rx), partial(_own, rx)),
                _opt(core.receivers[r]),
                _opt(core.jobs[r]),
                r in core.unverified,
                r in core.restarted,
                r in core.engaged,
                ()
                if run is None
                else (
                    r in run.required,
                    r in run.members,
                    bound[r],
                    r in run.applied,
                    run.disproved is not None and r in run.disproved,
                ),
                registered is not None and r in registered.receivers,
                calls[r],
                reopens[r],
                readies[r],
                missing[r],
            )
        )
    return keys


def canonical_order(s: State) -> list[int]:
    """The receivers of ``s`` (normalized) in canonical order: ``order[i]`` becomes ``i``."""
    keys = _keys(s)
    return sorted(range(len(keys)), key=keys.__getitem__)


def canonical(s: State) -> State:
    """``s`` normalized (:func:`normalize_seen`) with receivers in a canonical order."""
    s = normalize_seen(s)
    order = canonical_order(s)
    if order == list(range(len(order))):
        return s
    return renumber(s, order)


def renumber(s: State, order: list[int]) -> State:
    """``s`` with receiver ``order[i]`` renamed ``i``."""
    new = {old: i for i, old in enumerate(order)}

    def rs(xs: frozenset[int]) -> frozenset[int]:
        return frozenset(new[x] for x in xs)

    def pairs(xs: frozenset[tuple[int, int]]) -> frozenset[tuple[int, int]]:
        return frozenset((new[x], inc) for x, inc in xs)

    core = s.core._replace(
        receivers=tuple(s.core.receivers[o] for o in order),
        jobs=tuple(s.core.jobs[o] for o in order),
        unverified=rs(s.core.unverified),
        restarted=rs(s.core.restarted),
        engaged=rs(s.core.engaged),
    )
    run: Run | None = None
    if s.run is not None:
        run = s.run._replace(
            required=rs(s.run.required),
            members=rs(s.run.members),
            bound=pairs(s.run.bound),
            applied=rs(s.run.applied),
            disproved=None if s.run.disproved is None else rs(s.run.disproved),
        )
    registered: Registered | None = None
    if s.registered is not None:
        registered = s.registered._replace(receivers=rs(s.registered.receivers))
    return s.evolve(
        core=core,
        run=run,
        registered=registered,
        receivers=tuple(s.receivers[o] for o in order),
        to_receivers=frozenset(c._replace(receiver=new[c.receiver]) for c in s.to_receivers),
        reopens=frozenset(c._replace(receiver=new[c.receiver]) for c in s.reopens),
        readies=frozenset(m._replace(receiver=new[m.receiver]) for m in s.readies),
        commits=tuple(c._replace(missing=pairs(c.missing)) for c in s.commits),
    )
