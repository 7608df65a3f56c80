"""The benchmark workloads: the ``--rates`` notation, real AdamW steps on fp32 masters, and the
measured changed fraction."""

from __future__ import annotations

import argparse

import pytest
import torch

from dcr.bench.workloads import (
    Workload,
    changed_fraction,
    changed_text,
    label_of,
    new_version,
    parse_workloads,
    workloads,
)
from dcr.cli.arguments import _workloads
from dcr.models.updates import adamw_update, perturb

BF16 = torch.bfloat16


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few bf16 tensors like a model's (N(0, 0.02), a norm near 1, an integer buffer), one
    larger than a block of the AdamW update."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(300, 1000, generator=gen) * 0.02).to(BF16),
        "proj.weight": (torch.randn(64, 96, generator=gen) * 0.02).to(BF16),
        "norm.weight": (1.0 + torch.randn(96, generator=gen) * 0.02).to(BF16),
        "positions": torch.arange(10, dtype=torch.int64),
        "empty": torch.empty(0, dtype=BF16),
    }


def _words_changed(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


# -- the notation ---------------------------------------------------------------------------


def test_rates_and_adamw_tokens_parse_with_their_labels():
    got = parse_workloads("0.001,0.03, 0.15,1.0,adamw:1e-6,ADAMW:1e-5,adamw:0.0001")
    assert got == [
        Workload("perturb", 0.001),
        Workload("perturb", 0.03),
        Workload("perturb", 0.15),
        Workload("perturb", 1.0),
        Workload("adamw", 1e-6),
        Workload("adamw", 1e-5),
        Workload("adamw", 1e-4),
    ]
    assert [w.label for w in got] == [
        "0.1%", "3%", "15%", "100%", "adamw lr=1e-06", "adamw lr=1e-05", "adamw lr=0.0001",
    ]  # fmt: skip
    assert [w.rate for w in got] == [0.001, 0.03, 0.15, 1.0, None, None, None]
    # Numbers (what run_*_bench always took) are change rates.
    assert workloads([0.03, Workload("adamw", 1e-5)]) == [got[1], got[5]]


@pytest.mark.parametrize(
    "text",
    ["0", "1.5", "-0.01", "nan", "inf", "abc", "adamw", "adamw:", "adamw:0", "adamw:-1e-5",
     "adamw:inf", "adamw:nan", "adamw:fast", "sgd:1e-3", ":0.1", "0.01,2", "", ","],
)  # fmt: skip
def test_bad_tokens_are_rejected(text):
    with pytest.raises(ValueError):
        parse_workloads(text)
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(0, 1\]|at least one"):
        _workloads(text)


def test_a_workload_checks_its_value():
    with pytest.raises(ValueError, match="fraction"):
        Workload("perturb", 0.0)
    with pytest.raises(ValueError, match="learning rate"):
        Workload("adamw", -1.0)
    with pytest.raises(ValueError, match="kind"):
        Workload("sgd", 0.1)  # type: ignore[arg-type]


def test_rows_written_before_workloads_still_have_labels():
    assert label_of({"rate": 0.03}) == "3%"
    assert label_of({"rate": 0.3, "workload": "adamw lr=1e-05"}) == "adamw lr=1e-05"
    assert changed_text({"rate": 0.03}) == ""
    assert changed_text({"changed_fraction": 0.15488}) == "15.5%"


# -- new versions -----------------------------------------------------------------------------


def test_new_version_is_perturb_or_adamw():
    base = _weights()
    by_rate = new_version(base, Workload("perturb", 0.2), seed=5)
    want = perturb(base, rate=0.2, seed=5)
    by_lr = new_version(base, Workload("adamw", 1e-5), seed=5)
    want_lr = adamw_update(base, lr=1e-5, seed=5)
    for name in base:
        assert torch.equal(by_rate[name].view(torch.uint8), want[name].view(torch.uint8))
        assert torch.equal(by_lr[name].view(torch.uint8), want_lr[name].view(torch.uint8))


def test_changed_fraction_counts_stored_bits():
    base = {"a": torch.zeros(4, dtype=BF16), "b": torch.ones(4, dtype=BF16)}
    new = {"a": torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=BF16), "b": base["b"].clone()}
    assert changed_fraction(base, new) == 1 / 8  # -0.0 == 0.0 as floats, not as bits
    new["b"][1:] = 2.0
    assert changed_fraction(base, new) == 4 / 8
    assert changed_fraction(base, base) == 0.0


# -- AdamW --------------------------------------------------------------------------------------


def test_adamw_update_is_deterministic_for_a_seed_and_keeps_dtype_and_shape():
    base = _weights()
    before = {n: t.clone() for n, t in base.items()}
    one = adamw_update(base, lr=1e-5, seed=3)
    again = adamw_update(base, lr=1e-5, seed=3, threads=1)
    other = adamw_update(base, lr=1e-5, seed=4)
    assert set(one) == set(base)
    for name, t in base.items():
        assert one[name].dtype == t.dtype and one[name].shape == t.shape
        assert torch.equal(one[name].view(torch.uint8), again[name].view(torch.uint8)), name
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8))  # input kept
    assert torch.equal(one["positions"], base["positions"])  # integers pass through
    assert one["empty"].numel() == 0
    assert _words_changed(one["embed.weight"], other["embed.weight"]) > 0  # another seed


def test_more_words_change_at_a_higher_learning_rate():
    base = _weights()
    total = sum(t.numel() for t in base.values())
    fractions = {
        lr: changed_fraction(base, adamw_update(base, lr=lr, seed=1)) for lr in (1e-6, 1e-5, 1e-4)
    }
    assert 0 < fractions[1e-6] < fractions[1e-5] < fractions[1e-4] < 1
    # Weights ~ N(0, 0.02): about 2%, 15% and 88% of the words change (norms near 1 keep
    # their bits, their spacing is 2**-8).
    assert 0.005 < fractions[1e-6] < 0.05
    assert 0.08 < fractions[1e-5] < 0.3
    assert 0.6 < fractions[1e-4] < 0.98
    new = adamw_update(base, lr=1e-4, seed=1)
    assert _words_changed(new["norm.weight"], base["norm.weight"]) == 0
    assert total > 0


def test_the_words_that_change_are_those_a_step_of_lr_crosses_a_rounding_boundary_of():
    """A step moves each fp32 master by about lr (Adam normalizes the gradient): small
    weights, whose bf16 spacing is finer than the step, change; large ones do not."""
    w = _weights()["embed.weight"]
    new = adamw_update({"w": w}, lr=1e-5, seed=2)["w"]
    moved = w.view(torch.int16) != new.view(torch.int16)
    size = w.float().abs()
    assert 0 < int(moved.sum()) < w.numel()
    # half the bf16 spacing at |w| is at least |w| * 2**-9: above lr, nothing can change
    assert not bool(moved[size * 2.0**-9 > 1e-5 * 1.01].any())
    assert float(size[moved].mean()) < 0.5 * float(size[~moved].mean())


def test_adamw_update_steps_fp32_masters_and_casts_back():
    base = _weights()["embed.weight"]
    master = base.float()
    on_masters = adamw_update({"w": master}, lr=1e-3, seed=7)["w"]
    assert on_masters.dtype == torch.float32
    # One AdamW step from zero moments moves every element by lr * g / (|g| + eps) (about
    # lr, gradients being far above eps but for a few) plus the decoupled weight decay
    # lr * 0.01 * w.
    step = (on_masters - master).abs() / 1e-3
    assert float(step.max()) < 1.002
    assert float(((step - 1).abs() < 0.01).float().mean()) > 0.9
    # The bf16 update is that fp32 master update cast back (same gradients for a name).
    served = adamw_update({"w": base}, lr=1e-3, seed=7)["w"]
    assert torch.equal(served.view(torch.int16), on_masters.to(BF16).view(torch.int16))
    # More steps move further on average (random signs: a walk, not a line).
    three = adamw_update({"w": master}, lr=1e-3, seed=7, steps=3)["w"]
    assert float((three - master).abs().mean()) > 1.2e-3


def test_every_block_of_a_tensor_takes_its_own_first_step():
    """Blocks of a large tensor are stepped one after another on each thread: each starts
    from zero moments and step 0, whichever thread steps it after which block."""
    from dcr.models.updates import _ADAMW_BLOCK

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(5 * _ADAMW_BLOCK + 123, generator=gen) * 0.02
    serial = adamw_update({"w": w}, lr=1e-3, seed=2, threads=1)["w"]
    spread = adamw_update({"w": w}, lr=1e-3, seed=2, threads=3)["w"]
    assert torch.equal(serial, spread)
    step = ((serial - w).abs() / 1e-3).reshape(-1)
    for lo in range(0, w.numel(), _ADAMW_BLOCK):
        block = step[lo : lo + _ADAMW_BLOCK]
        assert float(block.max()) < 1.002
        assert float(((block - 1).abs() < 0.01).float().mean()) > 0.9
    # The gradients differ from block to block (no block repeats another's draws).
    moves = (serial - w)[: 2 * _ADAMW_BLOCK].sign().reshape(2, _ADAMW_BLOCK)
    assert not torch.equal(moves[0], moves[1])


def test_adamw_update_rejects_bad_arguments():
    base = _weights()
    for bad in (0.0, -1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lr"):
            adamw_update(base, lr=bad, seed=0)
    with pytest.raises(ValueError, match="steps"):
        adamw_update(base, lr=1e-5, seed=0, steps=0)


def test_lines_fraction_counts_the_64_byte_lines_holding_a_change() -> None:
    """32 bf16 elements per line: a change at 0 and at 31 is one line, at 32 a second; a
    float32 tensor has 16 per line, and its partial last line counts as a line."""
    from dcr.bench.workloads import lines_fraction

    base = {"a": torch.zeros(128, dtype=torch.bfloat16), "b": torch.zeros(20, dtype=torch.float32)}
    new = {k: v.clone() for k, v in base.items()}
    assert lines_fraction(base, new) == 0.0
    new["a"][[0, 31, 32]] = 1.0  # lines 0 and 1 of 4
    new["b"][19] = -0.0  # the sign bit alone: line 1 of 2 (its stored bits changed)
    assert lines_fraction(base, new) == 3 / 6
    new["a"][:] = 2.0
    new["b"][0] = 1.0
    assert lines_fraction(base, new) == 1.0
