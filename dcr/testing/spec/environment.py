"""The environment of ``models/refit.tla``: faults and the passing of time rather than
protocol triggers -- a receiver crash, a payload lost or delivered twice, a lost commit reply
and an expired commit deadline (the control plane's compare-and-set lives in
:mod:`dcr.testing.spec.commit`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from dcr.protocol.lifecycle import ReceiverPhase
from dcr.testing.spec.recovery import notice
from dcr.testing.spec.state import EMPTY, LOST, NONE, Cas, Payload, Reply, State
from dcr.testing.spec.steps import (
    RECEIVER_RUNNING,
    Builder,
    Config,
    Step,
    awaits_outcome,
    encoding_of,
    payload_key,
)

__all__ = [
    "crash_receiver",
    "duplicate_payload",
    "expire_deadline",
    "lose_commit_reply",
    "lose_payload",
]

_R = ReceiverPhase


def crash_receiver(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver process dies; its replacement starts JOINING with unknown storage."""
    if s.budgets.crashes == 0:
        return
    for r, rx in enumerate(s.receivers):
        if rx.phase is _R.JOINING:
            continue
        b = Builder(s)
        b.receiver(
            r,
            phase=_R.JOINING,
            attempt=NONE,
            inc=rx.inc + 1,
            gate_open=False,
            kv=EMPTY,
            storage=(LOST,) * len(s.owners),
            staged=frozenset(),
            applied=frozenset(),
            held=EMPTY,
            epoch=0,
            acked=NONE,
        )
        notice(b, s, cfg, r)
        yield b.step(
            f"crash_receiver(r{r})",
            inflight=frozenset(p for p in s.inflight if p.receiver != r),
            budgets=s.budgets._replace(crashes=s.budgets.crashes - 1),
        )


def lose_payload(s: State, cfg: Config) -> Iterator[Step]:
    if s.budgets.losses == 0:
        return
    budgets = s.budgets._replace(losses=s.budgets.losses - 1)
    for p in sorted(s.inflight, key=payload_key):
        yield Step(
            f"lose_payload(t{p.attempt},o{p.range},r{p.receiver})",
            replace(s, inflight=s.inflight - {p}, budgets=budgets),
            (),
        )


def duplicate_payload(s: State, cfg: Config) -> Iterator[Step]:
    """The transport delivers an already ingested payload again."""
    if s.budgets.duplicates == 0:
        return
    budgets = s.budgets._replace(duplicates=s.budgets.duplicates - 1)
    for r, rx in enumerate(s.receivers):
        if rx.attempt == NONE or rx.phase not in RECEIVER_RUNNING:
            continue
        a = s.attempt(rx.attempt)
        for x, enc in sorted(rx.staged) + [(x, encoding_of(s, a, x)) for x in sorted(rx.applied)]:
            p = Payload(rx.attempt, x, r, enc)
            if p not in s.inflight:
                yield Step(
                    f"duplicate_payload(t{p.attempt},o{x},r{r})",
                    replace(s, inflight=s.inflight | {p}, budgets=budgets),
                    (),
                )


def lose_commit_reply(s: State, cfg: Config) -> Iterator[Step]:
    """The reply to a compare-and-set is lost before its coordinator reads it."""
    if s.budgets.reply_losses == 0:
        return
    for tau, a in enumerate(s.attempts, start=1):
        if a.reply in (Reply.SUCCEEDED, Reply.FAILED, Reply.CONFLICT) and awaits_outcome(s, tau):
            b = Builder(s)
            b.attempt(tau, reply=Reply.LOST)
            yield b.step(
                f"lose_commit_reply(t{tau})",
                budgets=s.budgets._replace(reply_losses=s.budgets.reply_losses - 1),
            )


def expire_deadline(s: State, cfg: Config) -> Iterator[Step]:
    """The commit deadline of an attempt passes; the control plane refuses its commit after."""
    for tau, a in enumerate(s.attempts, start=1):
        if a.cas is not Cas.NONE and not a.expired and awaits_outcome(s, tau):
            b = Builder(s)
            b.attempt(tau, expired=True)
            yield b.step(f"expire_deadline(t{tau})")
