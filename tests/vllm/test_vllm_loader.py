"""vLLM's native loader on CPU: tiny checkpoints, the no-engine model build, what
``load_weights`` writes and reports, and the repacked-weights check."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_helpers import (
    Checkpoint,
    bit_mismatches,
    follows_weight_writes,
    linear_like,
    observed_repacked,
    pack_like_the_cpu_engine,
    pack_what_stayed_plain,
    parameter_states,
    run_cpu_engine_processing,
    snapshot,
    snapshot_mismatches,
    trace_writes,
)

from dcr.adapters.loaders.vllm import VllmLoader, find_repacked, vllm_distributed
from dcr.errors import ConfigError, LoaderPathUnsupported
from dcr.models.families import random_state_dict, tiny_config
from dcr.models.hf import read_checkpoint, write_checkpoint
from dcr.tensors.bits import bits

pytestmark = pytest.mark.vllm

FAMILIES = ("qwen3", "qwen3_moe", "llama")
Build = Callable[[Path], torch.nn.Module]


# --- checkpoints -------------------------------------------------------------------------------


def test_checkpoint_round_trip_keeps_every_bit(tmp_path: Path) -> None:
    config = tiny_config("qwen3_moe")
    sd = random_state_dict(config, "qwen3_moe", seed=3)
    raw = bits(sd["model.norm.weight"])
    raw[:5] = np.array([0x8000, 0x7F81, 0xFF80, 0x0001, 0x7FC3], dtype=np.uint16)
    path = write_checkpoint(tmp_path / "ck", config, "qwen3_moe", sd)
    back = read_checkpoint(path)
    assert sorted(back) == sorted(sd)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert np.array_equal(bits(back[name]), bits(t)), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["moe_intermediate_size"] == 48 and cfg["head_dim"] == 32
    assert not (path / "tokenizer.json").exists()


def test_checkpoint_config_parses_as_the_family_class(tmp_path: Path) -> None:
    from transformers import AutoConfig, Qwen3Config

    config = tiny_config("qwen3")
    path = write_checkpoint(tmp_path, config, "qwen3", random_state_dict(config, "qwen3"))
    parsed = AutoConfig.from_pretrained(path)
    assert isinstance(parsed, Qwen3Config)
    assert parsed.tie_word_embeddings is True
    assert parsed.head_dim == 32 and parsed.vocab_size == 250


def test_write_checkpoint_rejects_bad_input(tmp_path: Path) -> None:
    config = tiny_config("qwen3")
    sd = random_state_dict(config, "qwen3")
    with pytest.raises(ConfigError, match="family"):
        write_checkpoint(tmp_path, config, "llama", sd)
    missing = dict(sd)
    del missing["model.norm.weight"]
    with pytest.raises(ConfigError, match="missing"):
        write_checkpoint(tmp_path, config, "qwen3", missing)
    wrong = dict(sd)
    wrong["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as info:
        write_checkpoint(tmp_path, config, "qwen3", wrong)
    assert info.value.tensor == "model.norm.weight"
    mixed = dict(sd)
    mixed["model.norm.weight"] = sd["model.norm.weight"].float()
    with pytest.raises(ConfigError, match="mixes"):
        write_checkpoint(tmp_path, config, "qwen3", mixed)
    assert not (tmp_path / "model.safetensors").exists()


def test_read_checkpoint_needs_safetensors_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="safetensors"):
        read_checkpoint(tmp_path)


# --- the no-engine build and its dense load -------------------------------------------------------


def _expected_storage(ck: Checkpoint, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Where the dense load must put each checkpoint tensor (vLLM parameter names)."""
    sd = ck.state_dict

    def padded(t: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(padded_vocab - t.shape[0], t.shape[1], dtype=t.dtype)
        return torch.cat([t, pad])

    out = {"model.embed_tokens.weight": padded(sd["model.embed_tokens.weight"])}
    out["model.norm.weight"] = sd["model.norm.weight"]
    if "lm_head.weight" in sd:
        out["lm_head.weight"] = padded(sd["lm_head.weight"])
    for i in range(int(ck.config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = torch.cat(
            [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]
        )
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"]
        if ck.family != "llama":
            out[a + "q_norm.weight"] = sd[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = sd[a + "k_norm.weight"]
        m = p + "mlp."
        if ck.family == "qwen3_moe":
            e = int(ck.config["num_experts"])
            out[m + "gate.weight"] = sd[m + "gate.weight"]
            out[m + "experts.routed_experts.w13_weight"] = torch.stack(
                [
                    torch.cat(
                        [
                            sd[f"{m}experts.{j}.gate_proj.weight"],
                            sd[f"{m}experts.{j}.up_proj.weight"],
                        ]
                    )
                    for j in range(e)
                ]
            )
            out[m + "experts.routed_experts.w2_weight"] = torch.stack(
                [sd[f"{m}experts.{j}.down_proj.weight"] for j in range(e)]
            )
        else:
            out[m + "gate_up_proj.weight"] = torch.cat(
                [sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]
            )
            out[m + "down_proj.weight"] = sd[m + "down_proj.weight"]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_load_places_every_checkpoint_tensor(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny(family)
    model = build_model(ck.path)
    params = dict(model.named_parameters(remove_duplicate=False))
    padded_vocab = params["model.embed_tokens.weight"].shape[0]
    assert padded_vocab % 64 == 0 and padded_vocab > int(ck.config["vocab_size"])
    for name, want in _expected_storage(ck, padded_vocab).items():
        got = params[name]
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
        assert np.array_equal(bits(got), bits(want)), name
    if ck.config["tie_word_embeddings"]:
        assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    else:
        assert params["lm_head.weight"].data_ptr() != params["model.embed_tokens.weight"].data_ptr()
    if family == "qwen3_moe":
        # The router is one module under two names.
        assert (
            params["model.layers.0.mlp.gate.weight"]
            is params["model.layers.0.mlp.experts.gate.weight"]
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_two_builds_of_one_checkpoint_agree_bit_for_bit(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny(family)
    a, b = build_model(ck.path), build_model(ck.path)
    assert bit_mismatches(a, b) == []
    assert a.model.embed_tokens.weight.data_ptr() != b.model.embed_tokens.weight.data_ptr()


def test_bit_comparison_sees_a_single_sign_flip(
    write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny("qwen3")
    a, b = build_model(ck.path), build_model(ck.path)
    w = b.model.layers[1].mlp.down_proj.weight
    w.view(torch.int16).view(-1)[17] ^= -0x8000
    assert bit_mismatches(a, b) == ["model.layers.1.mlp.down_proj.weight"]


# --- what load_weights writes and reports ---------------------------------------------------------


def _fused_destination(name: str) -> str:
    for part, fused in (
        ("q_proj", "qkv_proj"),
        ("k_proj", "qkv_proj"),
        ("v_proj", "qkv_proj"),
        ("gate_proj", "gate_up_proj"),
        ("up_proj", "gate_up_proj"),
    ):
        if f".{part}." in name:
            return name.replace(part, fused)
    return name


def _load_into(
    loader: VllmLoader, weights: list[tuple[str, torch.Tensor]], reported: list[set[str] | None]
) -> None:
    reported.append(loader.load_weights(weights))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_one_copy_per_tensor_from_the_tensor_passed_in(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny(family)
    model = build_model(ck.path)
    loader = VllmLoader(model)
    for name, t in ck.state_dict.items():
        scratch = t.clone()
        reported: list[set[str] | None] = []
        writes = trace_writes(model, partial(_load_into, loader, [(name, scratch)], reported))
        copies = [w for w in writes if w.op == "copy_"]
        assert len(copies) == 1, (name, writes)
        (copy,) = copies
        assert copy.src_ptr == scratch.untyped_storage().data_ptr(), name
        assert copy.src_dtype == copy.dst_dtype == torch.bfloat16, name
        assert copy.dst_shape == tuple(t.shape), name
        fills = [w for w in writes if w.op != "copy_"]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # Vocabulary padding rows, zeroed on every load.
            assert [(w.op, w.dst, w.dst_offset) for w in fills] == [("fill_", copy.dst, t.numel())]
        else:
            assert fills == [], name
        if ".experts." in name:
            stem = "w2_weight" if "down_proj" in name else "w13_weight"
            expected = name.split(".experts.")[0] + f".experts.routed_experts.{stem}"
        else:
            expected = _fused_destination(name)
        assert reported == [{expected}], name
        assert copy.dst in (expected, expected.replace(".mlp.gate.", ".mlp.experts.gate."))


def test_loads_leave_bits_alone_when_values_repeat(
    write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny("qwen3_moe")
    model = build_model(ck.path)
    before = snapshot(model)
    VllmLoader(model).dense_load(ck.state_dict)
    assert snapshot_mismatches(model, before) == []


def test_tied_lm_head_is_dropped_and_cannot_load_alone(
    write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    ck = write_tiny("qwen3")
    model = build_model(ck.path)
    loader = VllmLoader(model)
    embed = ck.state_dict["model.embed_tokens.weight"]
    other = torch.full_like(embed, 3.0)
    before = snapshot(model)
    with pytest.raises(LoaderPathUnsupported) as info:
        loader.load_weights([("lm_head.weight", other)])
    assert info.value.tensor == "lm_head.weight"
    assert snapshot_mismatches(model, before) == []
    writes = trace_writes(
        model,
        lambda: loader.load_weights(
            [("model.embed_tokens.weight", embed), ("lm_head.weight", other)]
        ),
    )
    assert [w.op for w in writes] == ["copy_", "fill_"]
    assert snapshot_mismatches(model, before) == []


def test_unknown_name_is_converted_at_the_boundary(
    write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    model = build_model(write_tiny("llama").path)
    with pytest.raises(LoaderPathUnsupported) as info:
        VllmLoader(model).load_weights([("model.layers.0.mlp.nope.weight", torch.zeros(2))])
    assert info.value.tensor == "model.layers.0.mlp.nope.weight"
    assert info.value.check == "native-loader"
    assert isinstance(info.value.__cause__, ValueError)


def test_importing_dcr_and_the_adapter_does_not_import_vllm() -> None:
    code = (
        "import sys, dcr, dcr.adapters.loaders.vllm, dcr.models.hf, dcr.apply.applier\n"
        "bad = sorted(m for m in ('vllm', 'transformers', 'safetensors') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_loader_needs_a_model_with_load_weights() -> None:
    with pytest.raises(ConfigError):
        VllmLoader(torch.nn.Linear(2, 2))


def test_fp32_build_copies_through_a_cast(
    write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    from dcr.adapters.loaders.vllm import build_vllm_model

    ck = write_tiny("qwen3")
    model = build_vllm_model(ck.path, dtype=torch.float32)
    name = "model.layers.0.self_attn.o_proj.weight"
    writes = trace_writes(
        model, lambda: VllmLoader(model).load_weights([(name, ck.state_dict[name])])
    )
    assert [(w.op, w.src_dtype, w.dst_dtype) for w in writes] == [
        ("copy_", torch.bfloat16, torch.float32)
    ]


# --- repacked weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_check_ready_accepts_the_no_engine_build(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    model = build_model(write_tiny(family).path)
    assert find_repacked(model) == {}
    VllmLoader(model).check_ready()


@pytest.mark.parametrize("family", FAMILIES)
def test_find_repacked_reports_what_the_cpu_engine_processing_repacked(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    """What the CPU engine repacks depends on the machine (packed GEMM kernels or plain
    ``F.linear``); whatever it did here, exactly the modules it repacked are reported."""
    ck = write_tiny(family)
    model = build_model(ck.path)
    before = parameter_states(model)
    run_cpu_engine_processing(model, ck.path)
    repacked = observed_repacked(before, model)
    # The observation covers the linears: each one was either repacked or still computes with
    # its weight parameter.  The MoE experts are prepacked by every CPU MoE kernel.
    assert "model.layers.0.self_attn.qkv_proj" in repacked | linear_like(model).keys()
    if family == "qwen3_moe":
        assert {f"model.layers.{i}.mlp.experts.routed_experts" for i in range(2)} <= repacked
    assert set(find_repacked(model)) == repacked
    if repacked:
        with pytest.raises(LoaderPathUnsupported) as info:
            VllmLoader(model).check_ready()
        assert info.value.check == "repacked"
    else:
        VllmLoader(model).check_ready()


@pytest.mark.parametrize("family", FAMILIES)
def test_check_ready_rejects_cpu_engine_weight_processing(
    family: str, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    """The fully repacked state on every machine: after the CPU engine's processing, linears it
    left plain are packed the way packed-GEMM machines pack them."""
    ck = write_tiny(family)
    model = build_model(ck.path)
    before = parameter_states(model)
    run_cpu_engine_processing(model, ck.path)
    pack_what_stayed_plain(model)
    repacked = observed_repacked(before, model)
    assert linear_like(model).keys() <= repacked  # nothing computes with a plain weight now
    assert {
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "lm_head",
    } <= repacked
    assert set(find_repacked(model)) == repacked
    with pytest.raises(LoaderPathUnsupported) as info:
        VllmLoader(model).check_ready()
    assert info.value.check == "repacked"
    assert f"and {len(repacked) - 1} more modules" in str(info.value)


@pytest.mark.parametrize("remove_weight", [True, False], ids=["emptied", "weight-kept"])
def test_check_ready_rejects_one_linear_packed_after_the_build(
    remove_weight: bool, write_tiny: Callable[..., Checkpoint], build_model: Build
) -> None:
    """One linear of a plain model packed as the CPU GEMM dispatch packs it: that module, and
    only that one, is reported, whether the dense parameter was emptied or kept."""
    model = build_model(write_tiny("qwen3").path)
    qkv = model.model.layers[1].self_attn.qkv_proj
    weight = qkv.weight
    pack_like_the_cpu_engine(qkv, remove_weight=remove_weight)
    if remove_weight:
        assert qkv.weight.numel() == 0
    else:
        assert qkv.weight is weight and not follows_weight_writes(qkv)
    assert list(find_repacked(model)) == ["model.layers.1.self_attn.qkv_proj"]
    with pytest.raises(LoaderPathUnsupported) as info:
        VllmLoader(model).check_ready()
    assert info.value.check == "repacked"
    assert "'model.layers.1.self_attn.qkv_proj'" in str(info.value)
    assert "more modules" not in str(info.value)


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = object()


def test_find_repacked_on_synthetic_modules() -> None:
    root = torch.nn.Module()
    root.plain = _Linear(torch.ones(4, 4))
    root.fallback = _Linear(torch.ones(4, 4))
    root.fallback.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    root.direct = _Linear(torch.ones(4, 4))
    root.direct.cpu_linear = torch.nn.functional.linear
    assert find_repacked(root) == {}

    handle = torch.ones(4, 4)
    root.packed = _Linear(torch.ones(4, 4))
    root.packed.cpu_linear = lambda x, weight, bias: x @ handle
    root.emptied = _Linear(torch.empty(0))
    experts = _Linear(torch.ones(2, 4, 4))
    experts.quant_method = type("Method", (), {"moe_kernel": object()})()
    root.experts = experts
    found = find_repacked(root)
    assert sorted(found) == ["emptied", "experts", "packed"]
    assert "CPU GEMM" in found["packed"] and "MoE" in found["experts"]


def test_nested_distributed_scope_keeps_the_session_state(vllm_runtime: None) -> None:
    from vllm.distributed import model_parallel_is_initialized

    assert model_parallel_is_initialized()
    with vllm_distributed():
        pass
    assert model_parallel_is_initialized()
