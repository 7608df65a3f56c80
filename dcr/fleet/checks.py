"""How the launcher checks receivers hosted by an engine: the fingerprint of their stored bits.

A ``dcr receiver`` process reports digests of its parameters, which the launcher compares with
a dense load into the same sharded rank.  An engine's worker has vLLM's own layout (fused,
padded, sharded), which the launcher cannot rebuild; instead each time it holds a committed
version it reports the complete fingerprint of that version as its storage holds it
(:func:`~dcr.apply.proof.receiver_proof`: per canonical tensor, the sum of ``h(i, bits)`` over
the positions the rank holds, read back through the copies prewarm recorded) -- the same
proof the coordinator asks for at prepare.  The launcher computes the fingerprint of the
version's canonical tensors and judges the ranks of an engine together
(:func:`~dcr.protocol.proof.judge`: shards must add up, replicas agree), so one flipped bit
anywhere fails the check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dcr.protocol.proof import Proof, ProofRequest, TensorProof, judge, seed_for
from dcr.tensors.fingerprint import hash_view

__all__ = ["canonical_proof", "check_fingerprints", "holds_request", "proof_from_json",
           "proof_to_json"]  # fmt: skip


def holds_request(version: int) -> ProofRequest:
    """What a receiver reports of ``version`` when it holds it: the complete fingerprint
    under a seed of that version."""
    return ProofRequest(seed=seed_for(version, "holds"), samples=0, fingerprint=True)


def proof_to_json(proof: Proof) -> dict[str, Any]:
    """A fingerprint proof as JSON data for an event (integers stay exact)."""
    return {
        "seed": proof.seed,
        "tensors": [[t.name, t.count, t.coverage, t.value] for t in proof.tensors],
        "excluded": list(proof.excluded),
    }


def proof_from_json(raw: Mapping[str, Any]) -> Proof:
    """Inverse of :func:`proof_to_json`."""
    return Proof(
        seed=int(raw["seed"]),
        tensors=tuple(
            TensorProof(name=str(n), count=int(c), coverage=int(cov), value=int(v))
            for n, c, cov, v in raw["tensors"]
        ),
        fingerprinted=True,
        excluded=tuple(str(n) for n in raw["excluded"]),
    )


def canonical_proof(state: Mapping[str, torch.Tensor], request: ProofRequest) -> Proof:
    """The fingerprint of every canonical tensor of ``state``, as one owner holding them all
    would prove it."""
    tensors = []
    for name, t in state.items():
        data = t.contiguous()
        value = hash_view(data, 0, data.stride(), request.seed)
        tensors.append(TensorProof(name=name, count=data.numel(), value=value))
    return Proof(seed=request.seed, tensors=tuple(tensors), fingerprinted=True)


def check_fingerprints(
    version: int, state: Mapping[str, torch.Tensor], proofs: Mapping[str, Proof]
) -> dict[str, str]:
    """Receivers (the ranks of one engine, all of them) whose fingerprint of ``version``
    contradicts the canonical ``state``, with the reason; empty when every rank holds it bit
    for bit.  Tensors the proofs cannot settle fail every rank."""
    request = holds_request(version)
    verdict = judge(request, {"canonical": canonical_proof(state, request)}, proofs)
    failed = dict(verdict.failed)
    if verdict.unchecked:
        why = f"fingerprints that do not settle {list(verdict.unchecked)[:3]}"
        failed.update({r: failed.get(r, why) for r in proofs})
    return failed
