"""The initial checkpoint: a seeded bf16 Qwen3ForCausalLM directory that Hugging Face and vLLM
load as a downloaded model, and the models built from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from dcr.errors import ConfigError
from dcr.rl.config import RLConfig
from dcr.rl.policy import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    initial_state_dict,
    load_model,
    read_weights,
    write_initial_checkpoint,
)

SMALL = RLConfig(
    hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32
)


def test_the_default_model_is_a_small_untied_qwen3(tmp_path: Path) -> None:
    config = RLConfig()
    path = write_initial_checkpoint(tmp_path / "v0", seed=0, config=config)
    hf = json.loads((path / CONFIG_FILE).read_text())
    assert hf["architectures"] == ["Qwen3ForCausalLM"] and hf["model_type"] == "qwen3"
    assert hf["dtype"] == "bfloat16"
    assert hf["tie_word_embeddings"] is False
    assert hf["head_dim"] >= 32 and hf["vocab_size"] == config.vocab_size
    weights = read_weights(path)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    count = sum(t.numel() for t in weights.values())
    assert 5_000_000 <= count <= 30_000_000, count
    model = load_model(path, dtype=torch.float32)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(weights)


def test_the_checkpoint_is_a_pure_function_of_the_seed(tmp_path: Path) -> None:
    a = write_initial_checkpoint(tmp_path / "a", seed=3, config=SMALL)
    b = write_initial_checkpoint(tmp_path / "b", seed=3, config=SMALL)
    c = write_initial_checkpoint(tmp_path / "c", seed=4, config=SMALL)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / WEIGHTS_FILE).read_bytes() != (c / WEIGHTS_FILE).read_bytes()
    # Each tensor depends only on (seed, name): a deeper model shares the first layers' values.
    deeper = initial_state_dict(RLConfig(**{**SMALL.to_dict(), "num_layers": 3}), seed=3)
    for name, t in read_weights(a).items():
        if name != "model.norm.weight":
            assert torch.equal(deeper[name].view(torch.int16), t.view(torch.int16)), name
    norms = [t for n, t in deeper.items() if n.endswith("norm.weight")]
    assert all(bool((t == 1).all()) for t in norms)
    std = float(deeper["model.layers.0.mlp.up_proj.weight"].float().std())
    assert std == pytest.approx(SMALL.init_std, rel=0.05)


def test_models_hold_the_checkpoint_values_in_their_dtype(tmp_path: Path) -> None:
    path = write_initial_checkpoint(tmp_path / "v0", seed=1, config=SMALL)
    weights = read_weights(path)
    master = load_model(path, dtype=torch.float32)
    served = load_model(path, dtype=torch.bfloat16)
    for name, p in master.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(
            p.detach().to(torch.bfloat16).view(torch.int16), weights[name].view(torch.int16)
        )
    assert {p.dtype for p in served.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in served.buffers()} == {torch.float32}  # rotary frequencies stay fp32
    assert not served.training
    tokens = torch.tensor([[0, 2, 3, 4, 5, 1]])
    with torch.no_grad():
        logits = served(input_ids=tokens).logits
    assert logits.shape == (1, 6, SMALL.vocab_size) and logits.dtype == torch.bfloat16
    other = {n: torch.zeros_like(t) for n, t in weights.items()}
    zeroed = load_model(path, dtype=torch.bfloat16, state_dict=other)
    assert all(bool((p == 0).all()) for p in zeroed.parameters())
    with pytest.raises(ConfigError):
        load_model(
            path, dtype=torch.bfloat16, state_dict={"lm_head.weight": weights["lm_head.weight"]}
        )


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path: Path) -> None:
    path = write_initial_checkpoint(tmp_path / "v0", seed=1, config=SMALL)
    hf = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**hf, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        load_model(path, dtype=torch.float32)
