"""Every metric of :mod:`dcr.metrics`: its name, type, labels, buckets and meaning, and the
phases of a refit it times."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PREFIX = "dcr_"
"""Every metric's name starts with it."""

LABELS = ("fleet", "role", "name")
"""The labels of every series: the fleet (``[fleet] name``), the process's role
(``coordinator``, ``owner``, ``receiver``, ``relay``) and its name (``coordinator``, ``o0``,
``r1``, ``relay-node0``, ...)."""

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0,
           300.0, 600.0)  # fmt: skip
"""Histogram buckets of durations (seconds)."""
ATTEMPTS = (1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 16.0)
"""Histogram buckets of attempts per refit."""

INSTALL_HINT = "pip install 'dcr[metrics]'"

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric of the scheme: its full name, type, help text, labels beyond
    :data:`LABELS`, the roles that report it and, for a histogram, its buckets."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        return (*LABELS, *self.labels)


def _m(name: str, kind: Kind, roles: str, help_: str, *labels: str, buckets: Sequence[float] = ())\
        -> Metric:  # fmt: skip
    return Metric(f"{PREFIX}{name}", kind, help_, tuple(labels), tuple(roles.split()),
                  tuple(buckets))  # fmt: skip


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        # -- refits, as the coordinator runs them ---------------------------------------------
        _m("refits_total", "counter", "coordinator",
           "Transitions this coordinator ended, by outcome (committed, conflict, rejected, "
           "aborted, ...).", "outcome"),
        _m("refit_failures_total", "counter", "coordinator",
           "Transitions that ended without moving the commit record."),
        _m("attempts_total", "counter", "coordinator",
           "Attempts registered, by mode (mixed, overwrite).", "mode"),
        _m("attempt_failures_total", "counter", "coordinator",
           "Attempts that did not commit (a retry followed, or the transition failed)."),
        _m("refit_attempts", "histogram", "coordinator",
           "Attempts of each committed transition (1: no retry).", buckets=ATTEMPTS),
        _m("dense_refits_total", "counter", "coordinator",
           "Dense refits of joining or restarted receivers, by outcome (started, restored, "
           "failed).", "outcome"),
        _m("disproved_total", "counter", "coordinator",
           "Receivers whose proof of the base version failed at a prepare."),
        _m("endpoint_restarts_total", "counter", "coordinator",
           "Owners and receivers the coordinator saw come back as a new process."),
        _m("coordinator_active", "gauge", "coordinator",
           "1 while this coordinator holds the lease, 0 while it is a standby."),
        _m("staleness_versions", "gauge", "coordinator",
           "Versions the receiver is behind the commit record, as far as this coordinator "
           "knows (0: it holds the committed version).", "receiver"),
        # -- every role ----------------------------------------------------------------------
        _m("committed_version", "gauge", "coordinator owner receiver",
           "The committed version this process knows: the coordinator's commit record, the "
           "owner's baseline, the version the receiver holds."),
        _m("refit_phase_seconds", "histogram", "coordinator owner receiver",
           "Seconds of one phase of a committed refit (see docs/operations.md for each "
           "phase).", "phase", buckets=SECONDS),
        # -- owners --------------------------------------------------------------------------
        _m("payloads_total", "counter", "owner",
           "Attempt payloads the transport accepted from this owner."),
        _m("payload_bytes_total", "counter", "owner",
           "Bytes of the attempt payloads the transport accepted from this owner (V_payload)."),
        _m("refit_payload_bytes", "gauge", "owner",
           "Payload bytes this owner sent for its last committed refit, every attempt."),
        _m("refit_changed_elements", "gauge", "owner",
           "Canonical elements whose stored bits changed in the last committed refit, among "
           "those this owner compares."),
        _m("refit_change_ratio", "gauge", "owner",
           "This owner's changed elements over all the model's canonical elements, last "
           "committed refit; summed over owners it is the fleet's change rate."),
        _m("rollout_staleness_versions", "gauge", "owner",
           "Versions between the policy a training step's rollouts came from and the one it "
           "trained (the RL loop's rl-step events)."),
        # -- the rollout side ----------------------------------------------------------------
        _m("cross_bytes_total", "counter", "relay receiver",
           "Bytes that crossed from the trainer side into the rollout side (V_cross): the relay "
           "root's receive path, or a receiver process's GETs on object storage."),
        _m("payloads_applied_total", "counter", "receiver",
           "Payloads applied in place (refits and dense restores)."),
        _m("gate_closed_seconds", "histogram", "receiver",
           "Seconds the request gate stayed closed, from the close call to the reopen.",
           buckets=SECONDS),
        _m("relay_held_bytes", "gauge", "relay",
           "Payload bytes the relay node holds now (granted room included at the root)."),
    )
}  # fmt: skip

PHASES = {
    "refit": "coordinator: from the transition's start to its commit, retries included",
    "publish": "owner: from publish() to the commit and this owner's baseline update",
    "stage": "owner: the residual exchange of staging in the trainer's process group",
    "construct": "owner: wall seconds while at least one bucket of the refit was built and "
    "encoded (the union of its `built` intervals; synthetic trainer)",
    "transport": "owner: wall seconds while at least one of its payloads was in the "
    "transport's hands (the union of its `sent` intervals; synthetic trainer)",
    "baseline": "owner: the baseline update after the commit",
    "apply": "receiver: from the gate closed (requests drained) to the last payload applied",
    "commit": "receiver: from the last payload applied to the gate reopened (flush, "
    "acknowledgement, the commit record's compare-and-set, the holds report)",
}
"""The ``phase`` label's values of ``dcr_refit_phase_seconds`` and what each measures."""
