"""Small fleets for tests: a tiny model, small buckets (several payloads per owner, so that
a planned SIGKILL lands mid-refit), short deadlines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcr.demo import demo_fleet_file
from dcr.fleet.config import FleetConfig, load_fleet
from dcr.fleet.pids import alive

__all__ = ["TINY", "alive", "small_fleet"]

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip


def small_fleet(directory: Path, *, refits: int, rate: float = 0.05, **kw: Any) -> FleetConfig:
    path = demo_fleet_file(
        directory, size_mb=0, refits=refits, rate=rate, model_overrides=TINY,
        chunk_mb=0.03125, bucket_mb=0.0625, **kw,
    )  # fmt: skip
    return load_fleet(path)
