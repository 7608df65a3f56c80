"""A conformance suite for loaders: :class:`LoaderTests`, the base of pytest test classes.

It checks the contract of a :class:`~dcr.apply.loader.Loader` -- a serving runtime's native
weight loader -- as the :class:`~dcr.apply.applier.Applier` applies deltas through it (paper
§6.1, App. A.2):

* **bit preservation**: where prewarm classifies a name's loader path as bit-preserving
  (:attr:`~dcr.apply.paths.PathKind.PRESERVING`, so XOR and ULP entries are allowed), every
  copy the loader makes stores exactly the canonical bits it was given, compared as integer
  views of the storage; XOR and ULP entries then land bit-exact;
* **overwrite placement**: overwrite entries of every name land at their flat canonical
  positions and change nothing else: the storage ends bit-equal to a dense load of the new
  weights through a fresh loader;
* **the witness protocol**: each apply runs the loader again under the dispatch hook, and its
  writes must repeat those recorded at prewarm -- once per name and attempt (later payloads of
  the attempt reuse the witness, the next attempt witnesses anew); the proof of the base
  version reads the canonical bits back through the recorded copy geometry
  (:mod:`dcr.apply.proof`), and one flipped stored bit changes it;
* **refusal**: XOR and ULP entries on names whose path does not preserve bits, a storage the
  runtime replaced after prewarm, and repacked weights are refused with typed errors
  (:class:`~dcr.errors.PayloadRejected`, :class:`~dcr.errors.LoaderConditionViolated`,
  :class:`~dcr.errors.LoaderPathUnsupported`), every stored bit unchanged.

A loader's test module subclasses it -- ``class TestMyLoader(LoaderTests)`` -- and gives it
:meth:`LoaderTests.make_loader` (a new loader over a new module) and :meth:`LoaderTests.catalog`
(the canonical tensors it takes); the suite makes the weights (:meth:`LoaderTests.weights`)
and dense-loads them through the loader.  dcr's own loaders run it in
``tests/adapters/test_loaders.py`` and ``tests/vllm/test_vllm_loader_suite.py``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
import torch

from dcr.apply import Applier, ApplyConfig, Loader, PathKind
from dcr.apply.proof import StorageReader, readable, receiver_proof
from dcr.errors import LoaderConditionViolated, LoaderPathUnsupported, PayloadRejected
from dcr.protocol.proof import ProofRequest
from dcr.tensors.bits import bits, bits_dtype
from dcr.tensors.fingerprint import element_hashes, fold, sample_positions_of
from dcr.tensors.ordered import ULP_DTYPES, ulp_delta
from dcr.tensors.records import Encoding, Item, TensorSpec

__all__ = ["LoaderTests", "random_weights"]

Bits = npt.NDArray[np.unsignedinteger[Any]]

SPECIAL_BITS: dict[torch.dtype, tuple[int, ...]] = {
    torch.bfloat16: (0x0000, 0x8000, 0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8003),
    torch.float16: (0x0000, 0x8000, 0x7E00, 0x7C01, 0xFE05, 0x7C00, 0xFC00, 0x0001, 0x83FF),
    torch.float32: (0x0, 0x80000000, 0x7FC00000, 0x7F800001, 0xFFC00123, 0x7F800000,
                    0xFF800000, 0x1, 0x807FFFFF),
}  # fmt: skip
"""Bit patterns float comparisons get wrong: ±0, NaN payloads (quiet, signalling, negative),
±inf, subnormals."""


def random_weights(catalog: Mapping[str, TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    """A tensor for every spec of ``catalog``: small normal values for floats (with a few
    :data:`SPECIAL_BITS` planted), small integers, random booleans."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    out: dict[str, torch.Tensor] = {}
    for name, spec in catalog.items():
        if spec.dtype == torch.bool:
            t = torch.randint(0, 2, spec.shape, generator=gen).to(torch.bool)
        elif spec.dtype.is_floating_point:
            t = (0.1 * torch.randn(spec.shape, generator=gen)).to(spec.dtype)
            _plant(bits(t).reshape(-1), spec.dtype, rng, 2)
        else:
            t = torch.randint(-100, 100, spec.shape, generator=gen).to(spec.dtype)
        out[name] = t
    return out


def _plant(flat: Bits, dtype: torch.dtype, rng: np.random.Generator, count: int) -> None:
    patterns = SPECIAL_BITS.get(dtype)
    if patterns is None or flat.size == 0:
        return
    where = rng.choice(flat.size, size=min(count, flat.size), replace=False)
    flat[where] = rng.choice(np.array(patterns, dtype=np.uint64), size=where.size).astype(
        flat.dtype
    )


def _flat(t: torch.Tensor) -> Bits:
    """A copy of ``t``'s stored bits, flat, as unsigned integers."""
    return bits(t.detach().cpu().contiguous()).reshape(-1).copy()


def _snapshot(loader: Loader) -> dict[str, Bits]:
    """The stored bits of every tensor the loader may write."""
    return {name: _flat(t) for name, t in loader.storage_tensors()}


def _same(got: Mapping[str, Bits], want: Mapping[str, Bits], what: str) -> None:
    """Assert that two snapshots hold the same bits; the message names the tensors."""
    bad = _differ(got, want)
    assert not bad, f"stored bits differ from {what} in {bad[:8]}"


def _differ(a: Mapping[str, Bits], b: Mapping[str, Bits]) -> list[str]:
    """Names whose stored bits (or shapes, or presence) differ."""
    return sorted(set(a) ^ set(b)) + [
        n
        for n in sorted(set(a) & set(b))
        if a[n].dtype != b[n].dtype or not np.array_equal(a[n], b[n])
    ]


@dataclass(slots=True)
class _Change:
    """New bits of one canonical tensor at ``where`` (sorted flat positions)."""

    spec: TensorSpec
    where: npt.NDArray[np.int64]
    old: Bits
    new: Bits

    def item(self, encoding: Encoding, part: slice = slice(None)) -> Item:
        where, old, new = self.where[part], self.old[part], self.new[part]
        if encoding is Encoding.XOR:
            values = new ^ old
        elif encoding is Encoding.ULP:
            values = ulp_delta(new, old)
        else:
            values = new
        return Item(
            name=self.spec.name,
            shape=self.spec.shape,
            dtype=self.spec.dtype,
            encoding=encoding,
            indices=where,
            values=values,
        )


def _changes(
    weights: Mapping[str, torch.Tensor],
    specs: Iterable[TensorSpec],
    rng: np.random.Generator,
    rate: float,
    ties: Mapping[str, Collection[str]],
) -> tuple[dict[str, torch.Tensor], list[_Change]]:
    """New weights differing from ``weights`` at the first, middle, last and about ``rate``
    of the positions of every spec (special bit patterns among the new values).  A name tied
    to one changed before it (``ties``) changes the same way, as in a tied checkpoint."""
    new_weights = {n: t.clone() for n, t in weights.items()}
    done: dict[str, _Change] = {}
    for spec in specs:
        flat = bits(new_weights[spec.name]).reshape(-1)
        twin = next((done[n] for n in ties.get(spec.name, ()) if n in done), None)
        if twin is not None:
            flat[twin.where] = twin.new
            done[spec.name] = _Change(spec=spec, where=twin.where, old=twin.old, new=twin.new)
            continue
        if flat.size == 0:
            continue
        chosen = np.flatnonzero(rng.random(flat.size) < rate)
        where = np.unique(np.concatenate([chosen, [0, flat.size // 2, flat.size - 1]]))
        old = flat[where].copy()
        noise = 1 if spec.dtype == torch.bool else rng.integers(1, 1 << 7, size=where.size)
        new = old ^ np.asarray(noise).astype(old.dtype)
        _plant(new, spec.dtype, rng, 2)
        keep = new != old
        where, old, new = where[keep].astype(np.int64), old[keep], new[keep]
        if where.size:
            flat[where] = new
            done[spec.name] = _Change(spec=spec, where=where, old=old, new=new)
    return new_weights, list(done.values())


def _ties(applier: Applier, weights: Mapping[str, torch.Tensor]) -> dict[str, set[str]]:
    """Names whose loader writes share storage (tied weights) and that hold the same bits:
    an update changes them together."""
    ties: dict[str, set[str]] = {}
    for name, path in applier.paths.items():
        for other in path.overlaps:
            a, b = weights[name], weights[other]
            if a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_flat(a), _flat(b)):
                ties.setdefault(name, set()).add(other)
    return ties


@dataclass(slots=True, eq=False)
class _Rig:
    """A loader holding ``weights`` (dense-loaded) and its prewarmed applier."""

    loader: Loader
    applier: Applier
    weights: dict[str, torch.Tensor]
    ties: dict[str, set[str]]

    def changes(
        self, names: Iterable[str], rng: np.random.Generator, rate: float
    ) -> tuple[dict[str, torch.Tensor], list[_Change]]:
        """New weights and their changes on ``names`` (tied names kept tied)."""
        specs = [self.applier.catalog[n] for n in sorted(names)]
        return _changes(self.weights, specs, rng, rate, self.ties)


class LoaderTests:
    """The loader conformance suite; subclass it as ``Test<YourLoader>`` and give it
    :meth:`make_loader` and :meth:`catalog` (optionally :meth:`weights` and :meth:`repack`)."""

    seed: ClassVar[int] = 0
    """Seeds the weights and the changes."""
    rate: ClassVar[float] = 0.05
    """About this share of every tensor's positions changes per update."""
    apply_config: ClassVar[ApplyConfig] = ApplyConfig(huge_pages=False)
    """The receivers' settings."""

    def make_loader(self) -> Loader:
        """A new loader over a new module (any contents: the suite dense-loads it)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_loader()")

    def catalog(self) -> Mapping[str, TensorSpec]:
        """The canonical tensors the loader takes (the training side's catalog)."""
        raise NotImplementedError(f"{type(self).__name__} must define catalog()")

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        """Canonical weights for :meth:`catalog` (default: :func:`random_weights`)."""
        return random_weights(self.catalog(), seed)

    def repack(self, loader: Loader) -> bool:
        """Bring ``loader``'s module into a state in-place writes cannot reach (weights
        repacked after loading, as a runtime's post-load processing does) and return
        ``True``; its :meth:`~dcr.apply.loader.Loader.check_ready` must then refuse it.
        Default: ``False``, the runtime never repacks (the check is skipped)."""
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _loaded(self, weights: Mapping[str, torch.Tensor]) -> Loader:
        loader = self.make_loader()
        loader.dense_load(weights)
        return loader

    def _ready(self) -> _Rig:
        weights = self.weights(self.seed)
        loader = self._loaded(weights)
        applier = Applier(loader, self.catalog(), self.apply_config)
        applier.prewarm()
        return _Rig(loader=loader, applier=applier, weights=weights, ties=_ties(applier, weights))

    def _dense(self, weights: Mapping[str, torch.Tensor]) -> dict[str, Bits]:
        """What a fresh loader stores after a dense load of ``weights``."""
        return _snapshot(self._loaded(weights))

    def _rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, salt])

    # -- prewarm -------------------------------------------------------------------------------

    def test_prewarm_classifies_every_name_and_changes_nothing(self) -> None:
        """Prewarm gives every catalog name a path and changes no stored bit; a dense load is
        deterministic (a second loader stores the same bits), which the checks rely on."""
        weights = self.weights(self.seed)
        loader = self._loaded(weights)
        before = _snapshot(loader)
        applier = Applier(loader, self.catalog(), self.apply_config)
        report = applier.prewarm()
        assert set(applier.paths) == set(self.catalog()), "prewarm left names unclassified"
        assert report.names == len(applier.paths)
        _same(_snapshot(loader), before, "the dense load before prewarm")
        _same(self._dense(weights), before, "a second loader's dense load of the same weights")
        for name in applier.xor_allowed():
            assert applier.paths[name].kind in (PathKind.PRESERVING, PathKind.SKIP), (
                f"{name} takes XOR entries but its path is {applier.paths[name].kind.value}"
            )

    # -- bit preservation ----------------------------------------------------------------------

    def test_preserving_paths_store_the_given_bits(self) -> None:
        """Every copy on a bit-preserving path stores exactly the canonical bits it was given:
        the destination view, read as integers, equals the source view of the weights."""
        rig = self._ready()
        preserving = [n for n, p in rig.applier.paths.items() if p.kind is PathKind.PRESERVING]
        if not preserving:
            pytest.skip("no name's loader path preserves bits")
        reader = StorageReader(rig.applier)
        for name in preserving:
            canon = rig.weights[name].detach().cpu().contiguous().reshape(-1)
            canon = canon.view(bits_dtype(canon.dtype))
            for copy in rig.applier.paths[name].copies:
                src = canon.as_strided(copy.src.shape, copy.src.stride, copy.src.offset)
                stored = reader.view(copy.dst).cpu()
                stored = stored.view(bits_dtype(stored.dtype))  # compared as integer bits
                same = stored.shape == src.shape and bool((stored == src).all())
                assert same, f"{name}: stored bits differ in {copy.dst}"

    def _relative(self, encoding: Encoding) -> None:
        rig = self._ready()
        names = [
            n
            for n in rig.applier.xor_allowed()
            if encoding is not Encoding.ULP or rig.applier.catalog[n].dtype in ULP_DTYPES
        ]
        if not names:
            pytest.skip(f"no name takes {encoding.name} entries on this loader")
        new, changes = rig.changes(names, self._rng(1), self.rate)
        rig.applier.apply_items([c.item(encoding) for c in changes], attempt=1)
        _same(_snapshot(rig.loader), self._dense(new), "a dense load of the new weights")

    def test_xor_entries_land_bit_exact(self) -> None:
        """XOR entries on every name that takes them end bit-equal to a dense load."""
        self._relative(Encoding.XOR)

    def test_ulp_entries_land_bit_exact(self) -> None:
        """ULP entries on every float name that takes them end bit-equal to a dense load."""
        self._relative(Encoding.ULP)

    # -- overwrite placement -------------------------------------------------------------------

    def test_overwrite_lands_at_the_given_positions(self) -> None:
        """Overwrite entries of every name, whatever its path, land at their flat positions and
        nowhere else: the storage equals a dense load of the new weights."""
        rig = self._ready()
        new, changes = rig.changes(rig.applier.catalog, self._rng(2), self.rate)
        rig.applier.apply_items([c.item(Encoding.OVERWRITE) for c in changes], attempt=1)
        _same(_snapshot(rig.loader), self._dense(new), "a dense load of the new weights")

    def test_one_element_of_one_name_changes_only_its_own_bits(self) -> None:
        """An overwrite of the last element of one name (and of the names tied to it) changes
        exactly what a dense load of that change changes, for every name in turn (applied,
        then taken back)."""
        rig = self._ready()
        base = _snapshot(rig.loader)
        reference = self._loaded(rig.weights)
        rng = self._rng(3)
        for attempt, name in enumerate(sorted(rig.applier.catalog), start=1):
            group = [name, *sorted(rig.ties.get(name, ()))]
            _, changes = rig.changes(group, rng, 0.0)
            ones = [_Change(spec=c.spec, where=c.where[-1:], old=c.old[-1:], new=c.new[-1:])
                    for c in changes]  # fmt: skip
            if not ones:
                continue
            new = {n: t.clone() for n, t in rig.weights.items()}
            for one in ones:
                bits(new[one.spec.name]).reshape(-1)[one.where] = one.new
            reference.dense_load(new)
            rig.applier.apply_items([o.item(Encoding.OVERWRITE) for o in ones], attempt=attempt)
            _same(
                _snapshot(rig.loader), _snapshot(reference), f"a dense load of the change of {name}"
            )
            back = [_Change(spec=o.spec, where=o.where, old=o.new, new=o.old) for o in ones]
            rig.applier.apply_items([b.item(Encoding.OVERWRITE) for b in back], attempt=attempt)
            _same(_snapshot(rig.loader), base, f"the base version after taking back {name}")

    # -- the witness protocol ------------------------------------------------------------------

    def test_each_attempt_witnesses_the_loader_once_per_name(self) -> None:
        """The first payload of an attempt runs the loader for its names; a later payload of
        the attempt reuses those witnesses (no loader call); the next attempt witnesses anew;
        every witness repeats the writes recorded at prewarm."""
        rig = self._ready()
        names = [n for n in rig.applier.xor_allowed() if rig.applier.paths[n].copies]
        if not names:
            pytest.skip("no name takes XOR entries and is written on this loader")
        base = _snapshot(rig.loader)
        new, changes = rig.changes(names, self._rng(4), self.rate)
        first = [c.item(Encoding.XOR, slice(0, (len(c.where) + 1) // 2)) for c in changes]
        second = [c.item(Encoding.XOR, slice((len(c.where) + 1) // 2, None)) for c in changes]
        second = [i for i in second if i.count]
        calls = rig.applier.apply_items(first, attempt=1).loader_calls
        assert calls >= 1, "the first payload of an attempt did not run the loader"
        calls = rig.applier.apply_items(second, attempt=1).loader_calls
        assert calls == 0, f"a later payload of the attempt ran the loader {calls} times"
        _same(_snapshot(rig.loader), self._dense(new), "a dense load of the new weights")
        # XOR masks are their own inverse: the next attempt takes the storage back.
        report = rig.applier.apply_items([c.item(Encoding.XOR) for c in changes], attempt=2)
        assert report.loader_calls >= 1, "the next attempt did not run the loader"
        _same(_snapshot(rig.loader), base, "the base version after XOR twice")

    def test_the_base_version_reads_back_from_storage(self) -> None:
        """The proof of the base version, read through the copy geometry prewarm recorded,
        holds the canonical bits: every sampled position and the fingerprint of the positions
        the loader holds; names on transforming paths are excluded."""
        rig = self._ready()
        paths = rig.applier.paths
        request = ProofRequest(seed=self.seed + 17, samples=64, fingerprint=True)
        proof = receiver_proof(rig.applier, request)
        held = {n: p for n, p in paths.items() if p.kind is not PathKind.SKIP and p.copies}
        unreadable = {n for n, p in held.items() if not all(readable(c) for c in p.copies)}
        assert set(proof.excluded) == unreadable, (proof.excluded, unreadable)
        assert {t.name for t in proof.tensors} == set(held) - unreadable
        sizes = {n: rig.applier.catalog[n].numel for n in held}
        positions = sample_positions_of(request.seed, sizes, request.samples)
        for t in proof.tensors:
            canon = _flat(rig.weights[t.name])
            for slot, value in zip(t.samples[::2], t.samples[1::2], strict=True):
                at = int(positions[t.name][slot])
                assert int(canon[at]) == value, f"{t.name}: position {at} reads back {value:#x}"
            where = np.unique(np.concatenate([c.src.positions() for c in held[t.name].copies]))
            assert t.count == where.size > 0, t.name
            assert t.value == fold(element_hashes(where, canon[where], request.seed)), t.name

    def test_a_flipped_stored_bit_changes_the_proof(self) -> None:
        """One bit flipped in the storage of a readable copy changes that name's proof."""
        rig = self._ready()
        request = ProofRequest(seed=self.seed + 23, samples=0, fingerprint=True)
        before = {t.name: t for t in receiver_proof(rig.applier, request).tensors}
        alone = sorted(n for n in before if not rig.applier.paths[n].overlaps)
        if not alone:
            pytest.skip("no name's stored bits can be read back on this loader")
        name = alone[0]
        dst = rig.applier.paths[name].copies[0].dst
        stored = StorageReader(rig.applier).flat(dst.storage, dst.dtype)
        with torch.no_grad():
            stored[dst.offset] ^= 1
            after = {t.name: t for t in receiver_proof(rig.applier, request).tensors}
            stored[dst.offset] ^= 1
        assert after[name] != before[name], f"a flipped bit of {name} left its proof unchanged"
        assert {n: t for n, t in after.items() if n != name} == {
            n: t for n, t in before.items() if n != name
        }

    # -- refusal -------------------------------------------------------------------------------

    def test_relative_entries_off_preserving_paths_are_refused(self) -> None:
        """XOR (and, for floats, ULP) entries on a name whose path does not preserve bits, or
        whose writes overlap another name's, are refused (``check="classification"``) with
        the whole payload: every stored bit unchanged."""
        rig = self._ready()
        catalog = rig.applier.catalog
        refused = sorted(set(catalog) - rig.applier.xor_allowed())
        if not refused:
            pytest.skip("every name takes XOR entries on this loader")
        before = _snapshot(rig.loader)
        _, changes = rig.changes(catalog, self._rng(5), self.rate)
        valid = [c.item(Encoding.OVERWRITE) for c in changes if c.spec.name not in refused]
        for change in (c for c in changes if c.spec.name in refused):
            for encoding in (Encoding.XOR, Encoding.ULP):
                if encoding is Encoding.ULP and change.spec.dtype not in ULP_DTYPES:
                    continue
                with pytest.raises(PayloadRejected) as err:
                    rig.applier.apply_items([*valid, change.item(encoding)], attempt=1)
                assert err.value.check == "classification", err.value
                assert err.value.tensor == change.spec.name, err.value
                _same(_snapshot(rig.loader), before, "the storage before the refused apply")

    def test_a_storage_replaced_after_prewarm_is_refused(self) -> None:
        """Weights the runtime moved to new storage after prewarm (in-place writes would miss
        them) are refused before any write (``check="storage-replaced"``) and put back."""
        rig = self._ready()
        written = [p for p in rig.applier.paths.values() if p.copies]
        if not written:
            pytest.skip("the loader writes no storage")
        path = written[0]
        label = path.copies[0].dst.storage
        tensor = dict(rig.loader.storage_tensors())[label]
        ptr = tensor.untyped_storage().data_ptr()
        before = _snapshot(rig.loader)
        _, (change,) = rig.changes([path.name], self._rng(6), self.rate)
        with torch.no_grad():
            tensor.data = tensor.data.clone()
        with pytest.raises(LoaderConditionViolated) as err:
            rig.applier.apply_items([change.item(Encoding.OVERWRITE)], attempt=1)
        assert err.value.check == "storage-replaced", err.value
        assert tensor.untyped_storage().data_ptr() == ptr
        _same(_snapshot(rig.loader), before, "the storage before the refused apply")

    def test_repacked_weights_are_refused(self) -> None:
        """A loader whose weights were repacked after loading refuses prewarm
        (:class:`~dcr.errors.LoaderPathUnsupported`) and nothing changes."""
        loader = self._loaded(self.weights(self.seed))
        if not self.repack(loader):
            pytest.skip("the runtime keeps its weights in the loaded layout (no repack)")
        before = _snapshot(loader)
        with pytest.raises(LoaderPathUnsupported):
            loader.check_ready()
        with pytest.raises(LoaderPathUnsupported):
            Applier(loader, self.catalog(), self.apply_config).prewarm()
        _same(_snapshot(loader), before, "the storage before the refused prewarm")
