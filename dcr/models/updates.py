"""Synthetic policy updates and a canonical-space sharded receiver.

:func:`perturb` makes the benchmark's update (paper §8.1 "Element change rates"): a chosen
fraction of elements is updated as ``bf16(w * (1 + 0.01 * eps))``, ``eps`` standard normal, so
some chosen elements keep their stored bits, as in BF16 training.  :func:`adamw_update` makes
an optimizer's update instead: real ``torch.optim.AdamW`` steps on an fp32 master copy, with
synthetic gradients, so which words change follows the learning rate against each weight's
bf16 spacing.  :func:`special_patterns` plants bit patterns that float comparisons get wrong.
:func:`apply_to_state_dict` applies items directly to canonical tensors, the simplest receiver
there is.
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from dcr.tensors.bits import bits
from dcr.tensors.ordered import ordered, unordered
from dcr.tensors.parallel import default_threads, ordered_map
from dcr.tensors.records import Encoding, Item

__all__ = ["adamw_update", "apply_to_state_dict", "perturb", "special_patterns"]

_ADAMW_BLOCK = 1 << 18
"""Elements stepped together by :func:`adamw_update`: the fp32 weights, gradient and the two
moments of a block (4 MiB) stay in cache for all its steps."""


def perturb(
    state_dict: Mapping[str, torch.Tensor],
    *,
    rate: float,
    seed: int,
    relative: float = 0.01,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with about ``rate`` of the elements of each tensor updated.

    Each element is chosen independently with probability ``rate``; chosen elements become
    ``cast(w * (1 + relative * eps))`` computed in float32; unchosen elements keep their bits.
    ``names`` limits the update to some tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    chosen_names = set(state_dict) if names is None else set(names)
    out = {}
    for name, t in state_dict.items():
        if name not in chosen_names or t.numel() == 0 or not t.is_floating_point():
            out[name] = t.clone()
            continue
        new = t.clone().reshape(-1)
        idx = (torch.rand(new.numel(), generator=gen) < rate).nonzero().squeeze(1)
        if idx.numel():
            eps = torch.randn(idx.numel(), generator=gen, dtype=torch.float32)
            new[idx] = (new[idx].to(torch.float32) * (1.0 + relative * eps)).to(t.dtype)
        out[name] = new.reshape(t.shape)
    return out


def adamw_update(
    state_dict: Mapping[str, torch.Tensor],
    *,
    lr: float,
    seed: int,
    steps: int = 1,
    weight_decay: float = 0.01,
    grad_std: float = 1e-3,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` real :class:`torch.optim.AdamW` steps, cast back to their
    dtypes.

    What it models: a trainer keeping fp32 master weights (here the bf16 weights widened, so
    the masters start on the served grid) that steps AdamW (default betas and eps,
    ``weight_decay``) and serves the weights cast back to bf16.  Gradients are synthetic:
    normal, seeded, with a standard deviation of ``grad_std`` times the RMS of each tensor
    (1.0 for an all-zero tensor), a new draw per step.  Adam normalizes each element's step,
    so the first step moves every weight by about ``lr`` whatever the gradient's scale; a
    stored bf16 word changes once its master has moved past half the bf16 spacing at that
    weight (about ``|w| * 2**-9`` to ``|w| * 2**-8``).  So the fraction of words that change
    grows with ``lr`` and falls with the weights' magnitudes, as on a real trainer: on
    weights ~ N(0, 0.02) one step changes about 2% of the words at ``lr`` 1e-6, 15% at 1e-5
    and 88% at 1e-4, and norm weights near 1.0 keep their bits at all three.  No model
    forward or backward runs, so it runs anywhere.

    AdamW is elementwise (no gradient clipping here), so each tensor is stepped in blocks of
    :data:`_ADAMW_BLOCK` elements, every step of a block before the next block, on up to
    ``threads`` worker threads (default: the CPUs this process may use), each block with a
    fused optimizer at step 0: the same arithmetic as stepping the whole model at once,
    without holding fp32 copies and moments of more than a block per thread.  Each block
    draws its gradients from a generator seeded with ``seed``, its tensor's name and its
    position, so the result depends on ``seed`` only (not on ``threads``, nor on the other
    tensors).  Tensors that are not floating point, or empty, are copied unchanged.  About
    4 s for a 1.16 GB bf16 model on two cores.
    """
    if not lr > 0 or not math.isfinite(lr):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed!r}")
    out: dict[str, torch.Tensor] = {}
    blocks: list[tuple[torch.Tensor, torch.Tensor, slice, float, list[int]]] = []
    for name, t in state_dict.items():
        if t.numel() == 0 or not t.is_floating_point():
            out[name] = t.clone()
            continue
        src = t.detach().contiguous().reshape(-1)
        dst = torch.empty_like(src)
        out[name] = dst.view(t.shape)
        rms = _rms(src)
        scale = grad_std * (rms if rms > 0 and math.isfinite(rms) else 1.0)
        key = zlib.crc32(name.encode())
        for number, lo in enumerate(range(0, src.numel(), _ADAMW_BLOCK)):
            where = slice(lo, min(lo + _ADAMW_BLOCK, src.numel()))
            blocks.append((src, dst, where, scale, [seed, key, number]))

    local = threading.local()

    def optimizer(n: int, dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
        """This thread's master block of ``n`` elements and its AdamW optimizer, at step 0.

        Reused from block to block of one size (fresh buffers cost a page fault per 4 KiB):
        every AdamW state tensor (step count and both moments) starts at zero, so zeroing
        them is a fresh optimizer."""
        held = getattr(local, "held", None)
        if held is None or held[0].shape[0] != n or held[0].dtype != dtype:
            master = torch.nn.Parameter(torch.empty(n, dtype=dtype))
            opt = torch.optim.AdamW([master], lr=lr, weight_decay=weight_decay, fused=True)
            held = local.held = (master, opt)
        for value in held[1].state[held[0]].values():
            if isinstance(value, torch.Tensor):
                value.zero_()
        return held

    def step(block: tuple[torch.Tensor, torch.Tensor, slice, float, list[int]]) -> None:
        src, dst, where, scale, entropy = block
        words = np.random.SeedSequence(entropy).generate_state(1, np.uint64)
        gen = torch.Generator().manual_seed(int(words[0]))
        dtype = torch.promote_types(src.dtype, torch.float32)
        master, opt = optimizer(where.stop - where.start, dtype)
        with torch.no_grad():
            master.copy_(src[where])
        for _ in range(steps):
            grad = master.grad if master.grad is not None else torch.empty_like(master)
            torch.randn(master.shape, generator=gen, out=grad)
            master.grad = grad.mul_(scale)
            opt.step()
        dst[where].copy_(master.detach())

    for _ in ordered_map(step, blocks, threads=threads or default_threads()):
        pass
    return out


def _rms(flat: torch.Tensor) -> float:
    """The root mean square of ``flat`` in float32, a block at a time (one conversion of the
    whole tensor costs more than the rest of the sum; the same value for bf16 weights and for
    their float32 copy)."""
    squares = 0.0
    for lo in range(0, flat.numel(), _ADAMW_BLOCK):
        block = flat[lo : lo + _ADAMW_BLOCK]
        squares += float(torch.linalg.vector_norm(block, dtype=torch.float32)) ** 2
    return math.sqrt(squares / flat.numel())


def special_patterns(state_dict: Mapping[str, torch.Tensor], *, seed: int = 0) -> None:
    """Plant ``+0 -> -0``, NaN payloads, ±inf and subnormals in floating tensors, in place.

    Each floating tensor with at least 8 elements gets its first few elements rewritten with
    patterns chosen by ``seed``, so two calls with different seeds change their stored bits.
    """
    rng = np.random.default_rng(seed)
    for t in state_dict.values():
        if not t.is_floating_point() or t.numel() < 8:
            continue
        b = bits(t).reshape(-1)
        width = b.dtype.itemsize * 8
        sign = np.uint64(1) << np.uint64(width - 1)
        exp_bits = {16: 5 if t.dtype == torch.float16 else 8, 32: 8, 64: 11}.get(width, 4)
        mant = width - 1 - exp_bits
        exp_all = ((np.uint64(1) << np.uint64(exp_bits)) - np.uint64(1)) << np.uint64(mant)
        choices = [
            np.uint64(0),  # +0
            sign,  # -0
            exp_all | np.uint64(1),  # signalling-NaN payload
            exp_all | (np.uint64(1) << np.uint64(mant - 1)) | np.uint64(rng.integers(1, 4)),
            exp_all,  # +inf
            exp_all | sign,  # -inf
            np.uint64(1),  # smallest subnormal
            sign | np.uint64(rng.integers(1, 1 << min(mant, 20))),  # negative subnormal
        ]
        picks = rng.permutation(len(choices))
        b[: len(choices)] = np.array([choices[i] for i in picks], dtype=np.uint64).astype(b.dtype)


def apply_to_state_dict(state_dict: Mapping[str, torch.Tensor], items: Iterable[Item]) -> None:
    """Apply items in place to canonical tensors (XOR into, add ULP deltas to, or overwrite
    their stored bits)."""
    for item in items:
        flat = bits(state_dict[item.name]).reshape(-1)
        if item.encoding is Encoding.XOR:
            flat[item.indices] ^= item.values
        elif item.encoding is Encoding.ULP:
            with np.errstate(over="ignore"):
                flat[item.indices] = unordered(ordered(flat[item.indices]) + item.values)
        else:
            flat[item.indices] = item.values
