"""Admission and streaming (Algorithm B.1): the actions of ``models/refit.tla`` from the
prepare of an attempt to the receivers' completion ACKs -- prepare, send, ingest (with
deduplication), wait_for_requests, open_apply, apply in declared order, flush and ack."""

from __future__ import annotations

from collections.abc import Iterator

from dcr.protocol.lifecycle import AttemptPhase, OwnerPhase, ReceiverPhase, TransitionPhase, Trigger
from dcr.testing.spec.state import (
    NONE,
    V0,
    AttemptVar,
    Cas,
    Encoding,
    Payload,
    Reply,
    State,
    apply_entry,
)
from dcr.testing.spec.steps import (
    RECEIVER_RUNNING,
    Builder,
    Config,
    Step,
    acting,
    live_receivers,
    payload_key,
)

__all__ = [
    "ack",
    "apply",
    "deliver",
    "flush",
    "ingest",
    "open_apply",
    "prepare",
    "send",
    "wait_for_requests",
]

_A = AttemptPhase
_T = TransitionPhase
_O = OwnerPhase
_R = ReceiverPhase
_X = Trigger


def prepare(s: State, cfg: Config) -> Iterator[Step]:
    """Start an attempt; the control plane accepts it only from the active coordinator."""
    for c, cv in acting(s, cfg):
        if cv.tphase not in (_T.IDLE, _T.READMITTING, _T.RECOVERING) or s.epoch != c:
            continue
        if cv.attempt != NONE and cv.aphase is not _A.CLEANED:
            continue
        if len(s.attempts) >= cfg.max_attempts or s.record != NONE:
            continue
        if any(o.phase is not _O.IDLE for o in s.owners):
            continue
        eligible = [
            r
            for r, rx in enumerate(s.receivers)
            if rx.epoch <= c
            and (
                rx.phase in (_R.READY, _R.CLEANED)
                or (rx.phase is _R.REFITTED and rx.held == s.record_version)
            )
        ]
        if not eligible:
            continue
        b = Builder(s)
        tau = len(s.attempts) + 1
        b.attempts.append(
            AttemptVar(
                coord=c,
                overwrite=cv.overwrite,
                required=frozenset((r, s.receivers[r].inc) for r in eligible),
                acks=frozenset(),
                obsolete=False,
                cas=Cas.NONE,
                reply=Reply.NONE,
                expired=False,
            )
        )
        b.coord(
            c,
            tphase=b.go(cv.tphase, _X.PREPARE),
            aphase=b.go(_A.PLANNED, _X.PREPARE),
            attempt=tau,
            stopped=False,
        )
        for o, ow in enumerate(s.owners):
            b.owner(o, phase=b.go(ow.phase, _X.PREPARE), attempt=tau, sent=False)
        for r in eligible:
            rx = s.receivers[r]
            b.receiver(
                r,
                phase=b.go(rx.phase, _X.PREPARE),
                attempt=tau,
                staged=frozenset(),
                applied=frozenset(),
                epoch=c,
            )
        yield b.step(f"prepare(c{c})", registered=tau)


def send(s: State, cfg: Config) -> Iterator[Step]:
    """The coordinator starts the owners (admission); an owner sends its payload."""
    for c, cv in acting(s, cfg):
        if cv.aphase is _A.PREPARING:
            b = Builder(s)
            b.coord(c, aphase=b.go(cv.aphase, _X.SEND))
            if cv.tphase is _T.ADMITTING:
                b.coord(c, tphase=b.go(cv.tphase, _X.SEND), admitted=True)
            for o, ow in enumerate(s.owners):
                if ow.attempt == cv.attempt and ow.phase is _O.PREPARED:
                    b.owner(o, phase=b.go(ow.phase, _X.SEND))
            yield b.step(f"send(c{c})")
    for o, ow in enumerate(s.owners):
        if ow.phase is _O.SENDING and not ow.sent:
            a = s.attempt(ow.attempt)
            enc = (
                Encoding.OVERWRITE
                if a.overwrite
                else (Encoding.XOR_V0 if ow.baseline == V0 else Encoding.XOR_V1)
            )
            b = Builder(s)
            b.owner(o, phase=b.go(ow.phase, _X.SEND), sent=True)
            sent = frozenset(Payload(ow.attempt, o, r, enc) for r in live_receivers(s, ow.attempt))
            if cfg.atomic_delivery:
                for p in sorted(sent, key=payload_key):
                    deliver(b, p)
                yield b.step(f"send(o{o})")
            else:
                yield b.step(f"send(o{o})", inflight=s.inflight | sent)


def ingest(s: State, cfg: Config) -> Iterator[Step]:
    """A payload is delivered; the receiver drops other attempts' payloads and duplicates."""
    for p in sorted(s.inflight, key=payload_key):
        b = Builder(s)
        deliver(b, p)
        yield b.step(f"ingest(t{p.attempt},o{p.range},r{p.receiver})", inflight=s.inflight - {p})


def deliver(b: Builder, p: Payload) -> None:
    """Stage ``p`` if it belongs to the receiver's active attempt and is not a duplicate."""
    rx = b.receivers[p.receiver]
    seen = {x for x, _ in rx.staged} | rx.applied
    if rx.attempt == p.attempt and rx.phase in RECEIVER_RUNNING and p.range not in seen:
        b.receiver(
            p.receiver,
            phase=b.go(rx.phase, _X.INGEST),
            staged=rx.staged | {(p.range, p.encoding)},
        )


def wait_for_requests(s: State, cfg: Config) -> Iterator[Step]:
    """Close the gate: at once in synchronous RL, after the arrival check in asynchronous RL."""
    for c, cv in acting(s, cfg):
        if cv.aphase is not _A.STREAMING:
            continue
        live = live_receivers(s, cv.attempt)
        if not cfg.sync:
            if any(not (o.attempt == cv.attempt and o.sent) for o in s.owners):
                continue
            ranges = set(range(len(s.owners)))
            if any(
                s.receivers[r].attempt != cv.attempt
                or {x for x, _ in s.receivers[r].staged} != ranges
                for r, _ in s.attempt(cv.attempt).required
            ):
                continue
        b = Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.WAIT_FOR_REQUESTS))
        for r in live:
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.PREPARED and rx.epoch <= c:
                b.receiver(r, phase=b.go(rx.phase, _X.WAIT_FOR_REQUESTS), gate_open=False)
        yield b.step(f"wait_for_requests(c{c})")


def open_apply(s: State, cfg: Config) -> Iterator[Step]:
    """Every required receiver closed its gate; receivers may apply (obsolete ones ignore it)."""
    for c, cv in acting(s, cfg):
        if cv.aphase is not _A.GATING:
            continue
        required = s.attempt(cv.attempt).required
        if any(
            s.receivers[r].inc != inc or s.receivers[r].gate_open or s.receivers[r].epoch > c
            for r, inc in required
        ):
            continue
        b = Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.OPEN_APPLY))
        for r in live_receivers(s, cv.attempt):
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.GATED:
                b.receiver(r, phase=b.go(rx.phase, _X.OPEN_APPLY))
        yield b.step(f"open_apply(c{c})")


def apply(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver applies the next payload in declared order (never in arrival order)."""
    for r, rx in enumerate(s.receivers):
        if rx.phase not in (_R.APPLYING, _R.FLUSHING) or len(rx.applied) == len(s.owners):
            continue
        nxt = min(set(range(len(s.owners))) - rx.applied)
        for x, enc in rx.staged:
            if x == nxt:
                b = Builder(s)
                storage = list(rx.storage)
                storage[x] = apply_entry(storage[x], enc)
                b.receiver(
                    r,
                    phase=b.go(rx.phase, _X.APPLY),
                    storage=tuple(storage),
                    staged=rx.staged - {(x, enc)},
                    applied=rx.applied | {x},
                )
                yield b.step(f"apply(r{r},o{x})")


def flush(s: State, cfg: Config) -> Iterator[Step]:
    """Every owner sent its payload: close sends; receivers check arrival and drain."""
    for c, cv in acting(s, cfg):
        if cv.aphase is not _A.APPLYING:
            continue
        if any(
            not (o.attempt == cv.attempt and o.phase is _O.SENDING and o.sent) for o in s.owners
        ):
            continue
        b = Builder(s)
        b.coord(c, aphase=b.go(cv.aphase, _X.FLUSH))
        for o, ow in enumerate(s.owners):
            b.owner(o, phase=b.go(ow.phase, _X.FLUSH))
        for r in live_receivers(s, cv.attempt):
            rx = s.receivers[r]
            if rx.attempt == cv.attempt and rx.phase is _R.APPLYING:
                b.receiver(r, phase=b.go(rx.phase, _X.FLUSH))
        yield b.step(f"flush(c{c})")


def ack(s: State, cfg: Config) -> Iterator[Step]:
    """A receiver drained every declared payload and sends its completion ACK."""
    for r, rx in enumerate(s.receivers):
        if rx.phase is _R.FLUSHING and len(rx.applied) == len(s.owners):
            b = Builder(s)
            b.receiver(r, phase=b.go(rx.phase, _X.ACK), acked=rx.attempt)
            a = s.attempt(rx.attempt)
            b.attempt(rx.attempt, acks=a.acks | {(r, rx.inc)})
            yield b.step(f"ack(r{r})")
