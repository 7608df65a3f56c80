"""The arithmetic of ``dcr bench refit`` (paper §8.7, App. C "Timed window and intervals",
"Lower bounds"): from a fleet run's events, each committed refit's timed window, its
construction and transport lower bounds (unions of intervals clipped to the window), its
phases, V_payload and V_cross, and the CPU seconds each role used in the window."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["covered", "cpu_by_role", "refit_timings"]


def covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``intervals`` (paper App. C, "Lower
    bounds": each interval clipped to the timed window, empty intersections discarded,
    overlaps counted once, gaps excluded)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total = 0.0
    end = lo
    for a, b in clipped:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _by(events: Iterable[dict[str, Any]], kind: str) -> Iterator[dict[str, Any]]:
    return (e for e in events if e["event"] == kind)


def _role(who: str, owners: Sequence[str]) -> str:
    if who in owners:
        return "owners"
    if who.startswith("coordinator"):
        return "coordinator"
    return "relay" if who.startswith("relay-") else "receivers"


_RELAY_TAIL_S = 0.5
"""How long after the window a relay node's next report still closes its CPU bracket (two
ticks of its reports)."""


def cpu_by_role(
    events: Sequence[dict[str, Any]], t0: float, t1: float, owners: Sequence[str]
) -> dict[str, float]:
    """CPU seconds each role's processes used in ``[t0, t1]``, from the ``cpu`` clock every
    event carries.  Owners: from their own publish (their last event by ``t0``, or their
    first publish inside the window when it comes a little after ``t0``, the first owner's
    publish) to their last event by ``t1`` (the baseline update).  Receivers: from their
    first event from ``t0`` on (a payload fetched or applied) to their last by ``t1`` (the
    last applied).  The coordinator (the transition starts and ends): from its first event
    from ``t0`` on to its first from ``t1`` on.  Relay nodes: from their first event from
    ``t0`` on to their first from ``t1`` on if it comes within ``_RELAY_TAIL_S`` (a node
    reports traffic and buffers every tick while they change), else their last by ``t1`` (a
    node idle since before ``t1`` reports nothing until the next refit).  Processes busy
    between refits too (polling storage, pinging peers) are thus not charged for it; work
    no event brackets is not counted."""
    clocks: dict[str, list[tuple[float, float]]] = {}
    published: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cpu") is not None:
            clock = (float(e["t"]), float(e["cpu"]))
            clocks.setdefault(e["who"], []).append(clock)
            if e.get("event") == "publish" and t0 <= clock[0] <= t1:
                published.setdefault(e["who"], []).append(clock)
    out: dict[str, float] = {}
    for who, seen in clocks.items():
        seen.sort()
        role = _role(who, owners)
        if role == "owners":
            # An owner whose publish comes after t0 did its training step before it (the
            # step is not part of the refit): its window opens at that publish.
            before = (
                [min(published[who])[1]]
                if who in published
                else [c for t, c in seen if t <= t0][-1:] or [seen[0][1]]
            )
            after = [c for t, c in seen if t <= t1][-1:] or before
        elif role == "receivers":
            before = [c for t, c in seen if t0 <= t <= t1][:1]
            after = [c for t, c in seen if t0 <= t <= t1][-1:]
            if not before:
                continue
        else:
            before = [c for t, c in seen if t0 <= t <= t1][:1]
            if not before:
                continue  # no event inside the window brackets its work
            horizon = t1 + _RELAY_TAIL_S if role == "relay" else float("inf")
            after = [c for t, c in seen if t1 <= t <= horizon][:1] or (
                [c for t, c in seen if t <= t1][-1:] if role == "relay" else [seen[-1][1]]
            )
        out[role] = out.get(role, 0.0) + max(0.0, after[0] - before[0])
    return out


def refit_timings(
    events: Sequence[dict[str, Any]], *, owners: Sequence[str], relayed: bool
) -> list[dict[str, Any]]:
    """Per committed version: latency, the lower bounds, V_payload, V_cross, phases and CPU
    seconds by role, from a fleet run's events (:mod:`dcr.fleet.timing`, the coordinator's,
    the root's, the receivers')."""
    attempts: dict[int, set[int]] = {}
    committed: set[int] = set()
    for e in _by(events, "ended"):
        if e["who"].startswith("coordinator"):
            version = int(e["base"]) + 1
            attempts.setdefault(version, set()).update(int(x["attempt"]) for x in e["attempts"])
            if e["outcome"] in ("committed", "conflict") and int(e["record"]) > int(e["base"]):
                committed.add(version)
    publish = {(e["who"], int(e["version"])): float(e["t"]) for e in _by(events, "publish")}
    stage = {(e["who"], int(e["version"])): float(e.get("stage_s") or 0.0)
             for e in _by(events, "committed")}  # fmt: skip
    committed_at = {(e["who"], int(e["version"])): float(e["t"]) for e in _by(events, "committed")}
    baselines: dict[str, list[tuple[float, float]]] = {}
    for e in _by(events, "baseline"):
        baselines.setdefault(e["who"], []).append((float(e["start"]), float(e["end"])))
    transitions = {int(e["base"]) + 1: float(e["t"]) for e in _by(events, "transition")}
    traffic: dict[int, tuple[int, int]] = {}
    for e in _by(events, "traffic"):
        if e["who"].startswith("relay-"):
            for a, (v_cross, v_payload) in e["attempts"].items():
                traffic[int(a)] = (int(v_cross), int(v_payload))
    rows = []
    for version in sorted(committed):
        mine = attempts[version]
        starts = [publish[(o, version)] for o in owners if (o, version) in publish]
        if len(starts) != len(owners):
            continue
        t0 = min(starts)
        ends = []
        for o in owners:
            after = [b for b in baselines.get(o, []) if b[0] >= t0]
            ends.append(min(after)[1] if after else committed_at.get((o, version), t0))
        t1 = max(ends)
        construction: dict[str, list[tuple[float, float]]] = {o: [] for o in owners}
        transport: dict[str, list[tuple[float, float]]] = {o: [] for o in owners}
        for o in owners:
            begin = publish[(o, version)]
            construction[o].append((begin, begin + stage.get((o, version), 0.0)))
        sent: dict[tuple[str, int, int], int] = {}
        for e in _by(events, "sent"):
            if int(e["attempt"]) in mine and e["who"] in transport:
                end = float(e["t"])
                start = float(e["start"]) if e.get("start") is not None else end
                transport[e["who"]].append((start, end))
                sent[(e["who"], int(e["attempt"]), int(e["payload"]))] = int(e["size"])
        for e in _by(events, "built"):
            if int(e["attempt"]) in mine and e["who"] in construction:
                construction[e["who"]].append((float(e["start"]), float(e["end"])))
        fetched = 0
        for e in _by(events, "fetched"):
            if int(e["attempt"]) in mine:
                transport.setdefault(e["who"], []).append((float(e["start"]), float(e["end"])))
                fetched += int(e["size"])
        applied = [float(e["t"]) for e in _by(events, "applied") if int(e["attempt"]) in mine]
        cross: int | None
        if relayed:
            seen = [traffic[a] for a in mine if a in traffic]
            cross = sum(c for c, _ in seen) if seen else None
        else:
            cross = fetched or None
        stage_end = max(a + stage.get((o, version), 0.0) for (o, v), a in publish.items()
                        if v == version)  # fmt: skip
        builds = [iv[0] for o in owners for iv in construction[o][1:]]
        first_build = min(builds) if builds else stage_end
        last_applied = max(applied) if applied else first_build
        c_bound = max(covered(construction[o], t0, t1) for o in owners)
        t_bound = max((covered(iv, t0, t1) for iv in transport.values()), default=0.0)
        latency = t1 - t0
        rows.append(
            {
                "version": version,
                "attempts": len(mine),
                "latency_s": latency,
                "construction_bound_s": c_bound,
                "transport_bound_s": t_bound,
                "bound_ratio": latency / max(c_bound, t_bound) if max(c_bound, t_bound) else None,
                "payload_bytes": sum(sent.values()),
                "payloads": len(sent),
                "cross_bytes": cross,
                # Consecutive phases: an owner may begin building before the last one
                # finished staging (it builds ahead of the prepare), then admission is 0.
                "phases": {
                    "stage_s": stage_end - t0,
                    "admit_s": max(first_build, stage_end) - stage_end,
                    "stream_s": max(last_applied, first_build, stage_end)
                    - max(first_build, stage_end),
                    "finalize_s": t1 - max(last_applied, first_build, stage_end),
                },
                "transition_start_s": transitions.get(version, t0) - t0,
                "cpu_s": cpu_by_role(events, t0, t1, owners),
            }
        )
    return rows
