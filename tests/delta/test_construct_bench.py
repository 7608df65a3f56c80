"""The construct benchmark's rows: the entropy floor of the changed set and the stage seconds."""

from __future__ import annotations

import numpy as np
import pytest

from dcr.bench.construct import run_construct_bench, synthetic_config
from dcr.delta.entropy import gap_xor_floor_bytes
from dcr.models.families import random_state_dict
from dcr.models.updates import perturb
from dcr.tensors.bits import bits


def test_rows_carry_the_gap_xor_floor_of_their_changed_elements():
    out = run_construct_bench(size_bytes=1, rates=(0.03,), modes=("X", "P"), repeats=1)
    rows = {r["mode"]: r for r in out["results"]}
    x = rows["X"]
    # independent floor: the same update, one item per canonical tensor
    cfg = synthetic_config(1)
    base = random_state_dict(cfg, "llama", seed=0)
    new = perturb(base, rate=0.03, seed=1)
    parts = []
    for name in base:
        a, b = bits(new[name]).reshape(-1), bits(base[name]).reshape(-1)
        idx = np.flatnonzero(a != b)
        parts.append((idx, a[idx] ^ b[idx]))
    assert sum(p[0].size for p in parts) == x["changed_elements"]
    # owners split tensors into items whose first gaps restart: a few symbols differ
    assert x["entropy_floor_bytes"] == pytest.approx(gap_xor_floor_bytes(parts), rel=0.01)
    # the floor is a property of the changed set, not of the encoding that carried it
    assert rows["P"]["entropy_floor_bytes"] == pytest.approx(x["entropy_floor_bytes"])
    assert x["entropy_floor_ratio"] == pytest.approx(x["payload_bytes"] / x["entropy_floor_bytes"])
    assert {"detect", "project", "pack", "encode"} <= set(x["stage_seconds"])
