"""Codec benchmarks: how small XOR masks, byte planes and whole payloads get after zstd.

:func:`run_codec_bench` is the paper's Table 2 workload (§8.2, App. C "Synthetic codec
benchmark"): standard-normal BF16 inputs, FP32 Gaussian noise of amplitude ``a``, rounding to
BF16, and the changed words compressed as overwrite values, as XOR masks and (beyond the paper)
as byte-planed XOR masks.  :func:`run_sparse_bench` measures bytes per changed element with
locations included on the sparse refit workload of §8.1, :func:`run_layout_bench` compares
the payload value layouts on a many-tensor model, and :func:`run_floor_bench` sets whole
payloads (XOR or ULP values, format version 1 or 2) against the order-0 floor of gap-coded
positions plus XOR masks.  The figures are quoted in ``docs/wire-format.md``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from dcr.delta.entropy import gap_xor_floor_bytes, item_gaps, order0_bits
from dcr.models.families import canonical_shapes, tiny_config
from dcr.tensors.bits import bits
from dcr.tensors.ordered import ulp_delta
from dcr.tensors.records import Encoding, Item
from dcr.wire.decode import decode_payload
from dcr.wire.encode import encode_payload
from dcr.wire.format import HEADER_SIZE, DecodeLimits, PayloadHeader, ValueLayout
from dcr.wire.locations import encode_locations
from dcr.wire.planes import split_planes

__all__ = [
    "format_codec_table",
    "format_floor_table",
    "format_sparse_table",
    "run_codec_bench",
    "run_floor_bench",
    "run_layout_bench",
    "run_sparse_bench",
]

_INPUT_SEED = 42
_NOISE_SEED = 44
_HEADER = PayloadHeader(attempt=0, owner=0, payload_id=0, final=True)
_OWN = DecodeLimits(max_expansion=1 << 40)
"""The benchmark decodes its own payloads without a catalog, however well they compress."""


def _zstd_size(data: bytes | memoryview, level: int) -> int:
    return len(zstandard.ZstdCompressor(level=level).compress(data))


def _planes(words: npt.NDArray[np.unsignedinteger[Any]]) -> bytes:
    """The byte planes of ``words`` (all byte-0s, then all byte-1s, ...)."""
    out = np.empty((words.dtype.itemsize, words.shape[0]), dtype=np.uint8)
    split_planes(words, out)
    return out.tobytes()


def _le(words: npt.NDArray[np.unsignedinteger[Any]]) -> bytes:
    return words.astype(words.dtype.newbyteorder("<"), copy=False).tobytes()


def _entropy_bytes(data: bytes) -> float:
    """Order-0 entropy of ``data`` as bytes, in bytes."""
    if not data:
        return 0.0
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / len(data)
    return float(-(p * np.log2(p)).sum()) * len(data) / 8


def run_codec_bench(
    n: int = 20_000_000,
    amplitudes: tuple[float, ...] = (1e-4, 1e-3, 1e-2),
    level: int = 1,
    version: int = 1,
) -> dict[str, Any]:
    """Table 2 of the paper: compressed overwrite vs XOR streams of the changed BF16 words.

    Inputs are ``n`` standard-normal values drawn directly in BF16 (seed 42); one FP32 noise
    vector (seed 44) serves every amplitude ``a``; ``beta = bf16(float32(alpha) + a * noise)``
    with the scaling and the addition as separate FP32 operations.  Each stream holds the
    changed words in input order as little-endian u16, compressed alone at zstd ``level``.
    Extra keys give the ratios and whole-payload sizes (XOR item with its locations, payload
    format ``version``; 1, the format the quoted figures were measured in, by default).
    """
    alpha = torch.randn(
        n, generator=torch.Generator().manual_seed(_INPUT_SEED), dtype=torch.bfloat16
    )
    noise = torch.randn(
        n, generator=torch.Generator().manual_seed(_NOISE_SEED), dtype=torch.float32
    )
    alpha32 = alpha.float()
    old = bits(alpha)
    results = []
    for a in amplitudes:
        scaled = noise * torch.tensor(a, dtype=torch.float32)
        beta = (alpha32 + scaled).to(torch.bfloat16)
        new = bits(beta)
        changed = np.flatnonzero(old != new).astype(np.int64)
        overwrite = new[changed]
        xor = old[changed] ^ overwrite
        ow = _zstd_size(_le(overwrite), level)
        xb = _zstd_size(_le(xor), level)
        xp = _zstd_size(_planes(xor), level)
        item = Item(
            name="alpha",
            shape=(n,),
            dtype=torch.bfloat16,
            encoding=Encoding.XOR,
            indices=changed,
            values=xor,
        )
        results.append(
            {
                "a": a,
                "changed": int(changed.shape[0]),
                "overwrite_bytes": ow,
                "xor_bytes": xb,
                "xor_byteplane_bytes": xp,
                "overwrite_over_xor": ow / xb,
                "overwrite_over_xor_byteplane": ow / xp,
                "payload_plain_bytes": len(
                    encode_payload(
                        _HEADER, [item], level=level, layout=ValueLayout.PLAIN, version=version
                    )
                ),
                "payload_byteplane_bytes": len(
                    encode_payload(
                        _HEADER, [item], level=level, layout=ValueLayout.BYTEPLANE, version=version
                    )
                ),
            }
        )
    return {"results": results}


def format_codec_table(result: dict[str, Any]) -> str:
    """Human-readable Table 2 (1 MB = 10^6 bytes)."""
    lines = [
        f"{'a':>8} {'changed':>11} {'overwrite MB':>13} {'XOR MB':>9} {'XOR planes MB':>14}"
        f" {'ow/XOR':>7} {'ow/planes':>9}",
    ]
    for r in result["results"]:
        ow, xb, xp = r["overwrite_bytes"], r["xor_bytes"], r["xor_byteplane_bytes"]
        lines.append(
            f"{r['a']:>8.0e} {r['changed']:>11,} {ow / 1e6:>13.3f} {xb / 1e6:>9.3f}"
            f" {xp / 1e6:>14.3f} {ow / xb:>7.2f} {ow / xp:>9.2f}"
        )
    return "\n".join(lines)


def _sparse_update(
    w: torch.Tensor, fraction: float, relative: float, gen: torch.Generator
) -> torch.Tensor:
    """``w`` with ``fraction`` of its elements, chosen uniformly, set to ``w*(1+relative*eps)``.

    The product is computed in FP32 and rounded to ``w``'s dtype, so some chosen elements keep
    their stored bits (paper §8.1 "Element change rates").
    """
    n = w.numel()
    chosen = torch.randperm(n, generator=gen)[: max(1, round(fraction * n))]
    eps = torch.randn(chosen.shape[0], generator=gen, dtype=torch.float32)
    new = w.clone().reshape(-1)
    new[chosen] = (w.reshape(-1)[chosen].float() * (1 + relative * eps)).to(w.dtype)
    return new.reshape(w.shape)


def run_sparse_bench(
    n: int = 20_000_000,
    fraction: float = 0.03,
    relative: float = 1e-2,
    seed: int = 0,
    level: int = 1,
) -> dict[str, Any]:
    """Bytes per changed element, locations included, on one sparsely updated BF16 tensor.

    ``fraction`` of ``n`` standard-normal BF16 weights is updated by ``relative`` amplitude.
    Streams: the paper's layout (u16-or-wider gaps then XOR words, one zstd frame), byte-planed
    masks, byte-planed gaps and masks, the order-0 entropy of those byte planes, whole format
    version 1 payloads in both value layouts, the gap + XOR order-0 floor, and format version 2
    payloads with XOR masks and with ULP deltas.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen, dtype=torch.bfloat16)
    new = _sparse_update(w, fraction, relative, gen)
    old_bits, new_bits = bits(w), bits(new)
    changed = np.flatnonzero(old_bits != new_bits).astype(np.int64)
    m = int(changed.shape[0])
    xor = old_bits[changed] ^ new_bits[changed]
    gaps = encode_locations(changed).gaps
    gap_planes, xor_planes = _planes(gaps), _planes(xor)
    item = Item(
        name="w",
        shape=(n,),
        dtype=torch.bfloat16,
        encoding=Encoding.XOR,
        indices=changed,
        values=xor,
    )
    ulp_item = _bf16_item(n, Encoding.ULP, changed, ulp_delta(new_bits[changed], old_bits[changed]))
    per = 1 / max(m, 1)
    width = gaps.dtype.itemsize
    entropy = sum(_entropy_bytes(gap_planes[k * m : (k + 1) * m]) for k in range(width)) + sum(
        _entropy_bytes(xor_planes[k * m : (k + 1) * m]) for k in range(2)
    )
    return {
        "n": n,
        "changed": m,
        "changed_fraction": m / n,
        "gap_bytes": width,
        "bytes_per_changed": {
            "paper_layout": _zstd_size(_le(gaps) + _le(xor), level) * per,
            "byteplane_masks": _zstd_size(_le(gaps) + xor_planes, level) * per,
            "byteplane_gaps_and_masks": _zstd_size(gap_planes + xor_planes, level) * per,
            "order0_entropy_of_planes": entropy * per,
            "payload_plain": len(
                encode_payload(_HEADER, [item], layout=ValueLayout.PLAIN, version=1)
            )
            * per,
            "payload_byteplane": len(
                encode_payload(_HEADER, [item], layout=ValueLayout.BYTEPLANE, version=1)
            )
            * per,
            "gap_xor_floor": gap_xor_floor_bytes([(changed, xor)]) * per,
            "payload_v2_xor": len(encode_payload(_HEADER, [item], version=2)) * per,
            "payload_v2_ulp": len(encode_payload(_HEADER, [ulp_item], version=2)) * per,
        },
    }


def format_sparse_table(result: dict[str, Any]) -> str:
    """Human-readable bytes per changed element of :func:`run_sparse_bench`."""
    lines = [
        f"{result['changed']:,} of {result['n']:,} elements changed "
        f"({100 * result['changed_fraction']:.2f}%), gaps in {result['gap_bytes']} byte(s)",
    ]
    lines += [f"  {k:<26} {v:6.3f} B" for k, v in result["bytes_per_changed"].items()]
    return "\n".join(lines)


def run_layout_bench(
    fraction: float = 0.03,
    relative: float = 1e-2,
    seed: int = 0,
    level: int = 1,
    **config: Any,
) -> dict[str, Any]:
    """Payload bytes per changed element for a whole ``qwen3_moe`` model in one payload.

    Compares the two wire layouts of format version 1 with per-item byte planes (the same item
    table, but each item's gaps and values planed on their own, item after item), the
    alternative the byte-plane layout was chosen over.  ``config`` overrides fields of
    :func:`dcr.models.families.tiny_config`.
    """
    cfg = tiny_config("qwen3_moe", **config)
    gen = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {"fraction": fraction}
    for encoding in (Encoding.XOR, Encoding.OVERWRITE):
        items = []
        for name, shape in canonical_shapes(cfg, "qwen3_moe").items():
            w = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)
            w = w.to(torch.bfloat16)
            new = _sparse_update(w, fraction, relative, gen)
            old_bits, new_bits = bits(w).reshape(-1), bits(new).reshape(-1)
            idx = np.flatnonzero(old_bits != new_bits).astype(np.int64)
            vals = (
                new_bits[idx] if encoding is Encoding.OVERWRITE else old_bits[idx] ^ new_bits[idx]
            )
            items.append(
                Item(
                    name=name,
                    shape=tuple(shape),
                    dtype=torch.bfloat16,
                    encoding=encoding,
                    indices=idx,
                    values=vals,
                )
            )
        m = sum(it.count for it in items)
        plain = encode_payload(_HEADER, items, level=level, layout=ValueLayout.PLAIN, version=1)
        planes = encode_payload(
            _HEADER, items, level=level, layout=ValueLayout.BYTEPLANE, version=1
        )
        # Same item table, buffers planed item by item instead of per width class.
        body = zstandard.ZstdDecompressor().decompress(plain[HEADER_SIZE:])
        table_end = 24 + int.from_bytes(body[:8], "little")
        per_item = [body[:table_end]]
        per_item += [_planes(encode_locations(it.indices).gaps) for it in items]
        per_item += [_planes(it.values) for it in items]
        per_item_size = HEADER_SIZE + _zstd_size(b"".join(per_item), level)
        result["items"] = len(items)
        result["elements"] = sum(math.prod(it.shape) for it in items)
        result[encoding.name.lower()] = {
            "changed": m,
            "plain": len(plain) / m,
            "per_item_planes": per_item_size / m,
            "byteplane": len(planes) / m,
        }
    return result


def _bf16_item(
    n: int, encoding: Encoding, idx: npt.NDArray[np.int64], vals: npt.NDArray[Any]
) -> Item:
    return Item(
        name="w", shape=(n,), dtype=torch.bfloat16, encoding=encoding, indices=idx, values=vals
    )


def _best_seconds(fn: Any, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_floor_bench(
    n: int = 20_000_000,
    fractions: tuple[float, ...] = (0.01, 0.03, 0.05),
    relative: float = 1e-2,
    seed: int = 0,
    level: int = 1,
    repeats: int = 1,
) -> dict[str, Any]:
    """Whole payloads against the order-0 floor of gap-coded positions plus XOR masks.

    The paper's workload: ``n`` standard-normal BF16 weights, ``fraction`` of them chosen
    uniformly and updated as ``bf16(w * (1 + relative * eps))``.  The changed elements go into
    one item, as XOR masks or as ULP deltas, encoded in format version 1 (XOR only) and 2.
    Each row gives the payload bytes, the floor (:func:`dcr.delta.entropy.gap_xor_floor_bytes`
    of the same entries, and its gap and mask parts), the ratio, the bytes of the positions
    alone (the same payload with all-zero values), and encode / decode seconds (best of
    ``repeats``, one thread, validation, zstd and the digest included).
    """
    results = []
    for fraction in fractions:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(n, generator=gen, dtype=torch.bfloat16)
        new = _sparse_update(w, fraction, relative, gen)
        old_bits, new_bits = bits(w), bits(new)
        idx = np.flatnonzero(old_bits != new_bits).astype(np.int64)
        m = int(idx.shape[0])
        xor = old_bits[idx] ^ new_bits[idx]
        floor = gap_xor_floor_bytes([(idx, xor)])
        gap_floor = order0_bits(item_gaps(idx)) / 8
        values = {Encoding.XOR: xor, Encoding.ULP: ulp_delta(new_bits[idx], old_bits[idx])}
        for encoding, version in ((Encoding.XOR, 1), (Encoding.XOR, 2), (Encoding.ULP, 2)):
            it = _bf16_item(n, encoding, idx, values[encoding])
            data = encode_payload(_HEADER, [it], level=level, version=version)
            blank = _bf16_item(n, encoding, idx, np.zeros_like(xor))
            zeros = encode_payload(_HEADER, [blank], level=level, version=version)
            encode_s = _best_seconds(
                lambda it=it, v=version: encode_payload(_HEADER, [it], level=level, version=v),
                repeats,
            )
            decode_s = _best_seconds(lambda data=data: decode_payload(data, limits=_OWN), repeats)
            results.append(
                {
                    "fraction": fraction,
                    "changed": m,
                    "encoding": encoding.name,
                    "version": version,
                    "payload_bytes": len(data),
                    "floor_bytes": floor,
                    "gap_floor_bytes": gap_floor,
                    "mask_floor_bytes": floor - gap_floor,
                    "ratio": len(data) / floor,
                    "positions_bytes": len(zeros),
                    "encode_seconds": encode_s,
                    "decode_seconds": decode_s,
                }
            )
    return {"n": n, "relative": relative, "level": level, "results": results}


def format_floor_table(result: dict[str, Any]) -> str:
    """Human-readable :func:`run_floor_bench` (bytes per changed element)."""
    lines = [
        f"{'rate':>5} {'changed':>10} {'values':>6} {'v':>2} {'payload':>8} {'floor':>7}"
        f" {'ratio':>6} {'pos':>6} {'gap fl':>6} {'enc M/s':>8} {'dec M/s':>8}",
    ]
    for r in result["results"]:
        m = max(r["changed"], 1)
        lines.append(
            f"{100 * r['fraction']:>4.0f}% {r['changed']:>10,} {r['encoding']:>6} {r['version']:>2}"
            f" {r['payload_bytes'] / m:>8.4f} {r['floor_bytes'] / m:>7.4f} {r['ratio']:>6.3f}"
            f" {r['positions_bytes'] / m:>6.3f} {r['gap_floor_bytes'] / m:>6.3f}"
            f" {m / r['encode_seconds'] / 1e6:>8.1f} {m / r['decode_seconds'] / 1e6:>8.1f}"
        )
    return "\n".join(lines)
