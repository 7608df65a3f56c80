"""What a coordinator's prepare binds beyond the attempt description, and what it judges.

Two bindings travel with every :class:`~dcr.protocol.messages.Prepare`:

* the loader classification (:func:`bound_refused`): in mixed mode, the union of the
  required receivers' refused sets, so that owners encode exactly the other names relative;
* the proof of the base version (:class:`BaseProofs`): before admission, what endpoints must
  prove about the storage they hold; once every endpoint accepted, their proofs are judged
  and receivers that do not hold the base version leave the membership (paper App. B.2).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dcr.protocol import commands as cmd
from dcr.protocol import messages as msg
from dcr.protocol.attempt import Attempt
from dcr.protocol.proof import ProofConfig, ProofRequest, Verdict, judge, seed_for
from dcr.protocol.types import CommitRecord

__all__ = ["BaseProofs", "bound_refused"]


def bound_refused(
    reports: Mapping[str, frozenset[str]] | None, receivers: Iterable[str]
) -> frozenset[str] | None:
    """What a mixed-mode prepare of ``receivers`` binds as ``xor_refused``: the union of their
    reported refused sets (``reports``: receiver -> the canonical names its loader path does
    not preserve bit for bit).

    ``None`` -- the integration setup's ``xor_names`` decide -- when there are no reports, a
    receiver has not reported, or the union is larger than a control message carries
    (:data:`~dcr.protocol.messages.XOR_REFUSED_MAX_BYTES`).
    """
    if reports is None:
        return None
    union: set[str] = set()
    for r in receivers:
        mine = reports.get(r)
        if mine is None:
            return None
        union |= mine
    if msg.refused_size(union) > msg.XOR_REFUSED_MAX_BYTES:
        return None
    return frozenset(union)


class BaseProofs:
    """The coordinator's side of the proof of the base version: what each prepare asks for,
    and the verdicts judged so far (one per proving prepare).

    ``fingerprint`` requests the complete fingerprint at the first proving prepare (the
    supervisor sets it for receivers started or restored since the last check).
    """

    def __init__(self, config: ProofConfig | None, *, fingerprint: bool) -> None:
        self.config = config
        self._fingerprint_due = config is not None and (
            fingerprint or config.fingerprint_each_commit
        )
        self._verdicts: list[Verdict] = []

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """The proofs of the base version judged so far, one per proving prepare."""
        return tuple(self._verdicts)

    def request(
        self, tau: int, g: str, joined: frozenset[str], *, admitted: bool
    ) -> ProofRequest | None:
        """What this prepare asks endpoints to prove (only before admission: after it,
        receivers may hold the failed attempt's partial writes, which the overwrite retry
        repairs)."""
        proof = self.config
        if proof is None or admitted:
            return None
        fingerprint = self._fingerprint_due or (bool(joined) and proof.fingerprint_on_join)
        if not proof.samples and not fingerprint:
            return None
        return ProofRequest(seed=seed_for(tau, g), samples=proof.samples, fingerprint=fingerprint)

    def judge(self, a: Attempt) -> Verdict | None:
        """Judge the proofs of ``a`` once every endpoint accepted (``None``: nothing to judge,
        or judged already)."""
        if a.proof is None or a.judged:
            return None
        a.judged = True
        owners = {o: a.proofs.get(o) for o in a.info.owners}
        receivers = {r: a.proofs.get(r) for r in a.info.receivers}
        verdict = judge(a.proof, owners, receivers)
        self._verdicts.append(verdict)
        if a.proof.fingerprint:
            self._fingerprint_due = False
        return verdict

    def disproved(
        self, a: Attempt, record: CommitRecord, out: list[cmd.CoordinatorCommand]
    ) -> tuple[frozenset[str], str] | None:
        """Judge the proofs of ``a`` once every endpoint accepted: the receivers that failed
        and why the attempt fails, or ``None`` when none failed.

        Receivers whose storage does not hold the base version ``record`` are told so and
        restored by dense refit; they leave the membership and the attempt fails (before
        admission, so the retry runs in mixed mode without them).
        """
        verdict = self.judge(a)
        if verdict is None or not verdict.failed:
            return None
        failed = frozenset(verdict.failed)
        tau = a.info.attempt
        for r in sorted(failed):
            out.append(
                cmd.Call(
                    to=(r,),
                    message=msg.Disproved(attempt=tau, epoch=a.epoch, reason=verdict.failed[r]),
                )
            )
        out.append(cmd.RequestDenseRefit(record=record, receivers=failed))
        first = min(failed)
        reason = f"{len(failed)} receivers do not hold {record} ({first}: {verdict.failed[first]})"
        return failed, reason
