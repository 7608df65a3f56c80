"""State normalization for the search of ``models/membership.tla``: receivers are
interchangeable, and a ``seen`` epoch matters only through its comparisons with the epochs
still in play, so states that differ only there behave alike and are stored once."""

from __future__ import annotations

from dataclasses import replace

from dcr.testing.spec.membership.state import Registered, Run, State

__all__ = ["canonical", "normalize_seen"]


def normalize_seen(s: State) -> State:
    """Each receiver's ``seen`` moved to the lowest value ranked alike among the epochs in play.

    ``seen`` is compared only with epochs in play -- the lease, the run's epoch and the epochs
    of calls in flight -- and with newer epochs, which are at least the lease.  A ``seen`` in
    play stays; one strictly between two epochs in play becomes one above the lower, so every
    comparison (strict or not) comes out the same.
    """
    play = {0, s.lease}
    if s.run is not None:
        play.add(s.run.epoch)
    play |= {c.epoch for c in s.to_receivers} | {c.epoch for c in s.reopens}

    def rank(seen: int) -> int:
        return seen if seen in play else max(e for e in play if e < seen) + 1

    receivers = tuple(rx._replace(seen=rank(rx.seen)) for rx in s.receivers)
    if receivers == s.receivers:
        return s
    return replace(s, receivers=receivers)


def _opt(x: tuple[int | bool, ...] | None) -> tuple[int | bool, ...]:
    return () if x is None else (1, *x)


def _key(s: State, r: int) -> tuple[object, ...]:
    """Everything that concerns receiver ``r``, for the canonical order."""
    rx = s.receivers[r]
    run = s.run
    return (
        rx.phase.value,
        rx.inc,
        rx.storage,
        rx.held,
        rx.dirty,
        rx.gate,
        rx.seen,
        _opt(rx.dense),
        rx.acked,
        rx.foreign,
        _opt(s.core.receivers[r]),
        _opt(s.core.jobs[r]),
        r in s.core.unverified,
        r in s.core.restarted,
        r in s.core.engaged,
        ()
        if run is None
        else (
            r in run.required,
            r in run.members,
            tuple(sorted(inc for x, inc in run.bound if x == r)),
            r in run.applied,
            run.disproved is not None and r in run.disproved,
        ),
        s.registered is not None and r in s.registered.receivers,
        tuple(sorted((c.job, c.record, c.epoch) for c in s.to_receivers if c.receiver == r)),
        tuple(sorted((c.job, c.record, c.epoch) for c in s.reopens if c.receiver == r)),
        tuple(sorted((m.inc, m.job, m.record) for m in s.readies if m.receiver == r)),
        tuple(tuple(sorted(inc for x, inc in c.missing if x == r)) for c in s.commits),
    )


def canonical(s: State) -> State:
    """``s`` normalized (:func:`normalize_seen`) with receivers in a canonical order."""
    s = normalize_seen(s)
    n = len(s.receivers)
    keys = [_key(s, r) for r in range(n)]
    order = sorted(range(n), key=keys.__getitem__)
    if order == list(range(n)):
        return s
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
    return replace(
        s,
        core=core,
        run=run,
        registered=registered,
        receivers=tuple(s.receivers[o] for o in order),
        to_receivers=frozenset(c._replace(receiver=new[c.receiver]) for c in s.to_receivers),
        reopens=frozenset(c._replace(receiver=new[c.receiver]) for c in s.reopens),
        readies=frozenset(m._replace(receiver=new[m.receiver]) for m in s.readies),
        commits=tuple(c._replace(missing=pairs(c.missing)) for c in s.commits),
    )
