"""``dcr fp8 export`` and ``dcr bench fp8``: the FP8 rollout checkpoint of a BF16 checkpoint
holds exactly the quantizer's bits for every projection weight, keeps every other tensor's
bits, names its scales as vLLM reads them and says how it was made; bad sources are refused
and leave nothing written; the benchmark's delta gives the full quantization's bits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr.cli import main
from dcr.errors import CheckpointError, ConfigError
from dcr.models.families import canonical_shapes, random_state_dict, tiny_config
from dcr.models.fp8 import (
    export_checkpoint,
    quantization_config,
    quantized_names,
    rollout_names,
    scheme_of_config,
)
from dcr.models.hf import INDEX_FILE, read_checkpoint, write_checkpoint
from dcr.tensors.bits import bits
from dcr.tensors.fp8 import FP8_DTYPE, Fp8Scheme, quantize


def _source(tmp_path: Path, family: str = "qwen3_moe") -> tuple[Path, dict[str, torch.Tensor]]:
    cfg = tiny_config(family)
    sd = random_state_dict(cfg, family, seed=4)
    return write_checkpoint(tmp_path / "bf16", cfg, family, sd), sd


def test_quantized_names_are_the_projections_not_norms_embeddings_heads_or_routers() -> None:
    cfg = tiny_config("qwen3_moe", tie_word_embeddings=False)
    shapes = canonical_shapes(cfg, "qwen3_moe")
    names = quantized_names(shapes)
    assert names and all(n.endswith("_proj.weight") for n in names)
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in names
    kept = set(shapes) - set(names)
    assert {
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight",
    } <= kept  # fmt: skip
    made = rollout_names(shapes, Fp8Scheme(32))
    assert made[names[0]] == (names[0], names[0] + "_scale_inv")
    assert made["lm_head.weight"] == ("lm_head.weight",)


@pytest.mark.parametrize("block", [32, None], ids=["block", "channel"])
def test_an_export_holds_the_quantizers_bits(tmp_path: Path, block: int | None) -> None:
    src, sd = _source(tmp_path)
    scheme = Fp8Scheme(block)
    summary = export_checkpoint(src, tmp_path / "fp8", scheme)
    out = read_checkpoint(tmp_path / "fp8")
    names = set(quantized_names({n: tuple(t.shape) for n, t in sd.items()}))
    assert summary["quantized"] == len(names) and summary["kept"] == len(sd) - len(names)
    assert set(out) == set(sd) | {scheme.scale_name(n) for n in names}
    for name, t in sd.items():
        if name in names:
            q, s = quantize(t, scheme)
            assert out[name].dtype == FP8_DTYPE
            assert np.array_equal(bits(out[name]), bits(q))
            assert np.array_equal(bits(out[scheme.scale_name(name)]), bits(s))
        else:
            assert out[name].dtype == t.dtype and np.array_equal(bits(out[name]), bits(t))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(scheme)
    assert scheme_of_config(config) == scheme
    assert config["model_type"] == "qwen3_moe"


def test_an_export_can_be_sharded(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, "llama")
    export_checkpoint(src, tmp_path / "fp8", Fp8Scheme(16), shard_bytes=20_000)
    index = json.loads((tmp_path / "fp8" / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / "fp8" / f).exists() for f in files)
    assert set(index["weight_map"]) == set(read_checkpoint(tmp_path / "fp8"))


def test_bad_sources_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, "llama")
    export_checkpoint(src, tmp_path / "fp8", Fp8Scheme(32))
    with pytest.raises(CheckpointError, match="already quantized"):
        export_checkpoint(tmp_path / "fp8", tmp_path / "again", Fp8Scheme(32))
    assert not (tmp_path / "again").exists()
    with pytest.raises(ConfigError, match="overwrite its source"):
        export_checkpoint(src, src, Fp8Scheme(32))
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x", Fp8Scheme(32))
    fp32 = tmp_path / "fp32"
    cfg = tiny_config("llama")
    sd = {n: t.to(torch.float32) for n, t in random_state_dict(cfg, "llama", seed=1).items()}
    write_checkpoint(fp32, cfg, "llama", sd)
    with pytest.raises(ConfigError, match="bfloat16"):
        export_checkpoint(fp32, tmp_path / "y", Fp8Scheme(32))
    assert not (tmp_path / "y").exists()


def test_the_cli_exports_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = _source(tmp_path, "llama")
    assert main(["fp8", "export", str(src), str(tmp_path / "fp8"), "--block", "channel",
                 "--json"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"] == "per-output-channel" and summary["bytes_out"] < summary["bytes_in"]
    assert main(["fp8", "export", str(tmp_path / "fp8"), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_bench_fp8_reports_tiles_bytes_and_exactness(capsys: pytest.CaptureFixture[str]) -> None:
    """The smallest synthetic model, one workload: the delta is exact, touches tiles, and is
    smaller than the dense FP8 refit at a 1% change rate."""
    argv = ["bench", "fp8", "--size-mb", "1", "--rates", "0.01", "--blocks", "128",
            "--repeats", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["rows"]
    assert row["exact"] is True and row["scheme"] == "128x128 block"
    assert 0 < row["tiles_touched"] <= row["tiles"]
    assert 0 < row["delta_payload_bytes"] < row["dense_payload_bytes"]
    assert row["adaptive_payload_bytes"] <= row["delta_payload_bytes"]
