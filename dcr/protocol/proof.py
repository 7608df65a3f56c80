"""Proof of the base version: what owners and receivers report at prepare, and the verdict.

A receiver must hold exactly the committed version ``K^v`` before it takes part in an attempt
``v -> v+1`` (XOR masks and sparse overwrites assume it).  At prepare the coordinator asks
every endpoint for a :class:`Proof` of the base version (:class:`ProofRequest`):

* the **sample proof**: the stored bits of a seeded sample of canonical positions of every
  tensor.  Owners report the positions they own; each receiver reads the same positions from
  its own storage through the copy geometry its prewarm recorded (only the positions it
  holds, every copy of them).  Cheap, and it catches a wrong or stale version;
* the **fingerprint**: per tensor ``F(t) = sum_i h(i, bits(x_i)) mod (2^61 - 1)``, additive
  over canonical positions, so that owners compute it from their shards and the fleet's
  receivers from the positions they hold; it catches a single flipped bit anywhere.

The seed is derived from the attempt id and candidate id (:func:`seed_for`), so no endpoint
can precompute an answer, and it salts both checks.  :func:`judge` compares the reports; the
coordinator excludes every receiver it names (see ``docs/protocol.md``, "Proof of the base
version").  This module is pure integer arithmetic (stdlib only); the hashing of tensors lives
in :mod:`dcr.tensors.fingerprint` (owners) and :mod:`dcr.apply.proof` (receivers).

**Coverage and replicas.**  A receiver rank reports per tensor the number ``count`` of distinct
canonical positions it holds, a ``coverage`` hash of that set (``sum r^i mod p`` with ``r``
drawn from the seed: closed form for views, so it costs nothing) and ``value``, the
fingerprint of its positions, where a position held by ``m`` copies on the rank counts each
copy with weight ``1/m`` (so every copy is checked and the position still counts once).
Ranks holding the same set of positions (replicas) form a *coverage class*: every member of a
class must report the same value.  Ranks holding the whole tensor are compared with the
owners' fingerprint one by one; the partial classes of a tensor must partition it and their
values must add up to the owners' fingerprint.  A rank whose value disagrees with the
unique consistent choice fails; when no unique choice exists every partial holder of the
tensor fails.  Tensors whose partial classes do not partition the tensor (serving layouts of
different tensor-parallel sizes that split it differently) are left unchecked by the
fingerprint, and listed as such.

**Transforming loader paths** (casts, computed sources) do not keep the canonical bits in
storage, so they cannot be read back: a receiver lists such names in :attr:`Proof.excluded`
and neither check covers them there.  They still take part in every refit (overwrite only).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dcr.errors import ConfigError

__all__ = [
    "PRIME",
    "Proof",
    "ProofConfig",
    "ProofRequest",
    "TensorProof",
    "Verdict",
    "coverage_base",
    "full_coverage",
    "judge",
    "run_coverage",
    "seed_for",
    "view_coverage",
]

PRIME = (1 << 61) - 1
"""The Mersenne prime ``2^61 - 1``: fingerprints and coverage hashes are residues mod it."""

_MAX_COMBINATIONS = 256
"""Bound on the candidate combinations tried to localize disagreeing replicas."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProofConfig:
    """When the coordinator asks for a proof of the base version (default: sample proof at
    every prepare before admission, fingerprint when receivers join).

    ``samples`` is the number of positions per tensor of the sample proof (0 turns it off);
    ``fingerprint_on_join`` requests the complete fingerprint at a prepare that admits
    receivers restored by dense refit; ``fingerprint_each_commit`` requests it at the first
    prepare of every transition, i.e. once after each commit, before any receiver takes part
    in the next one.
    """

    samples: int = 64
    fingerprint_on_join: bool = True
    fingerprint_each_commit: bool = False

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ConfigError(f"samples must be >= 0, got {self.samples}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProofRequest:
    """What a prepare asks every endpoint to prove about the base version."""

    seed: int
    samples: int
    """Positions per tensor of the sample proof (0: none)."""
    fingerprint: bool
    """Whether the complete fingerprint is requested too."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorProof:
    """One endpoint's report on one canonical tensor.

    ``samples`` are flattened ``(slot, stored bits)`` pairs: ``slot`` numbers the tensor's
    sample positions (sorted, see :mod:`dcr.tensors.fingerprint`); a receiver lists one pair
    per copy of each sampled position it holds.  With a fingerprint: ``count`` positions
    (owners: owned elements; receivers: distinct positions held), their ``coverage`` hash
    (receivers only) and their fingerprint ``value``.
    """

    name: str
    samples: tuple[int, ...] = ()
    count: int = 0
    coverage: int = 0
    value: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Proof:
    """An endpoint's answer to a :class:`ProofRequest`.

    ``excluded`` names tensors a receiver holds only through transforming loader paths (or in
    part through them): neither check covers them on that receiver.
    """

    seed: int
    tensors: tuple[TensorProof, ...] = ()
    fingerprinted: bool = False
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The outcome of :func:`judge`: failing receivers with the reason, and what was covered."""

    failed: Mapping[str, str] = field(default_factory=dict)
    """Receiver -> why its storage does not hold the base version."""
    sampled: int = 0
    """Sampled (receiver, copy) positions compared."""
    fingerprinted: int = 0
    """Tensors whose fingerprint was checked."""
    unchecked: tuple[str, ...] = ()
    """Tensors the fingerprint could not check (no owner report, or partial holdings that do
    not partition the tensor)."""


def seed_for(attempt: int, candidate: str) -> int:
    """The proof seed of an attempt: a hash of its attempt id and candidate id (63 bits)."""
    digest = hashlib.blake2b(f"{attempt}:{candidate}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def coverage_base(seed: int) -> int:
    """The base ``r`` of coverage hashes ``sum r^i mod p`` for ``seed`` (2 <= r < p - 1)."""
    digest = hashlib.blake2b(f"coverage:{seed}".encode(), digest_size=8).digest()
    return 2 + int.from_bytes(digest, "little") % (PRIME - 3)


def _geometric(r: int, step: int, n: int) -> int:
    """``sum_{k<n} r^(k*step) mod p``."""
    q = pow(r, step, PRIME)
    if q == 1:
        return n % PRIME
    return (pow(q, n, PRIME) - 1) * pow(q - 1, PRIME - 2, PRIME) % PRIME


def run_coverage(r: int, start: int, length: int) -> int:
    """Coverage hash of the positions ``start .. start+length-1``."""
    return pow(r, start, PRIME) * _geometric(r, 1, length) % PRIME


def view_coverage(r: int, offset: int, shape: Iterable[int], stride: Iterable[int]) -> int:
    """Coverage hash of the positions a nested strided view selects (each counted once)."""
    total = pow(r, offset, PRIME)
    for size, step in zip(shape, stride, strict=True):
        total = total * _geometric(r, step, size) % PRIME
    return total


def full_coverage(r: int, numel: int) -> int:
    """Coverage hash of a whole tensor of ``numel`` elements."""
    return run_coverage(r, 0, numel)


# -- the verdict -----------------------------------------------------------------------------


def _fail(failed: dict[str, list[str]], receiver: str, why: str) -> None:
    failed.setdefault(receiver, []).append(why)


def _pairs(samples: tuple[int, ...]) -> Iterable[tuple[int, int]]:
    return zip(samples[0::2], samples[1::2], strict=True)


def _judge_samples(
    owners: Mapping[str, Proof], receivers: Mapping[str, Proof], failed: dict[str, list[str]]
) -> int:
    expected: dict[str, dict[int, int]] = {}
    for proof in owners.values():
        for t in proof.tensors:
            expected.setdefault(t.name, {}).update(_pairs(t.samples))
    compared = 0
    for name_r, proof in sorted(receivers.items()):
        skip = set(proof.excluded)
        for t in proof.tensors:
            want = expected.get(t.name)
            if want is None or t.name in skip:
                continue
            wrong = 0
            for slot, value in _pairs(t.samples):
                if slot in want:
                    compared += 1
                    wrong += want[slot] != value
            if wrong:
                _fail(failed, name_r, f"{t.name}: {wrong} sampled positions differ")
    return compared


def _judge_partial(
    name: str,
    numel: int,
    expected: int,
    r: int,
    partial: list[tuple[str, TensorProof]],
    failed: dict[str, list[str]],
) -> bool:
    """Coverage classes of partial holders; False when they do not partition the tensor."""
    classes: dict[tuple[int, int], dict[int, list[str]]] = {}
    for receiver, t in partial:
        classes.setdefault((t.count, t.coverage), {}).setdefault(t.value, []).append(receiver)
    if sum(k[0] for k in classes) != numel or (
        sum(k[1] for k in classes) % PRIME != full_coverage(r, numel)
    ):
        return False
    keys = sorted(classes)
    options = [sorted(classes[k]) for k in keys]
    combos = 1
    for o in options:
        combos *= len(o)
    choice: tuple[int, ...] | None = None
    if combos <= _MAX_COMBINATIONS:
        fits = [c for c in itertools.product(*options) if sum(c) % PRIME == expected]
        choice = fits[0] if len(fits) == 1 else None
    if choice is not None:
        for k, value in zip(keys, choice, strict=True):
            for v, members in classes[k].items():
                if v != value:
                    for m in members:
                        _fail(failed, m, f"{name}: fingerprint differs from its replicas'")
        return True
    for k in keys:
        for members in classes[k].values():
            for m in members:
                _fail(failed, m, f"{name}: the shards' fingerprints do not add up")
    return True


def _judge_fingerprints(
    seed: int,
    owners: Mapping[str, Proof],
    receivers: Mapping[str, Proof],
    failed: dict[str, list[str]],
) -> tuple[int, list[str]]:
    r = coverage_base(seed)
    numel: dict[str, int] = {}
    value: dict[str, int] = {}
    for proof in owners.values():
        for t in proof.tensors:
            numel[t.name] = numel.get(t.name, 0) + t.count
            value[t.name] = (value.get(t.name, 0) + t.value) % PRIME
    holders: dict[str, list[tuple[str, TensorProof]]] = {}
    excluded: set[str] = set()
    for receiver, proof in sorted(receivers.items()):
        if not proof.fingerprinted:
            continue
        excluded.update(proof.excluded)
        for t in proof.tensors:
            if t.count:
                holders.setdefault(t.name, []).append((receiver, t))
    checked = 0
    unchecked: list[str] = []
    for name, held in sorted(holders.items()):
        if name not in numel:
            unchecked.append(name)
            continue
        n, want, full = numel[name], value[name], full_coverage(r, numel[name])
        partial = []
        for receiver, t in held:
            if name in receivers[receiver].excluded:
                continue
            if t.count == n and t.coverage == full:
                if t.value != want:
                    _fail(failed, receiver, f"{name}: fingerprint differs")
            else:
                partial.append((receiver, t))
        if partial and (name in excluded or not _judge_partial(name, n, want, r, partial, failed)):
            unchecked.append(name)
            continue
        checked += 1
    return checked, unchecked


def judge(
    request: ProofRequest,
    owners: Mapping[str, Proof | None],
    receivers: Mapping[str, Proof | None],
) -> Verdict:
    """Compare the owners' and receivers' proofs of one request.

    A receiver fails when it sent no proof or a proof of another seed, when a sampled position
    it holds differs from the owners' bits, or when its fingerprint contradicts the owners'
    (see the module docstring for replicas and shards).  Tensors of an owner that sent no
    proof are not checked.
    """
    failed: dict[str, list[str]] = {}
    good_owners = {o: p for o, p in owners.items() if p is not None and p.seed == request.seed}
    good: dict[str, Proof] = {}
    for receiver, proof in receivers.items():
        if proof is None or proof.seed != request.seed:
            _fail(failed, receiver, "no proof of the base version for this attempt")
        elif request.fingerprint and not proof.fingerprinted:
            _fail(failed, receiver, "no fingerprint although one was requested")
        else:
            good[receiver] = proof
    sampled = _judge_samples(good_owners, good, failed) if request.samples else 0
    checked, unchecked = 0, list[str]()
    if request.fingerprint:
        owner_prints = {o: p for o, p in good_owners.items() if p.fingerprinted}
        checked, unchecked = _judge_fingerprints(request.seed, owner_prints, good, failed)
    reasons = {
        r: "; ".join(why[:3]) + (" ..." if len(why) > 3 else "") for r, why in failed.items()
    }
    return Verdict(
        failed=reasons,
        sampled=sampled,
        fingerprinted=checked,
        unchecked=tuple(unchecked),
    )
