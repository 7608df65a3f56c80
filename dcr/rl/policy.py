"""The policy: a small Qwen3 causal LM built locally and saved as a Hugging Face checkpoint.

:func:`write_initial_checkpoint` writes version 0 of an RL run -- ``config.json`` (bf16,
``Qwen3ForCausalLM``, untied embeddings) and ``model.safetensors`` in bf16 -- with weights that
are a pure function of the seed: each tensor is drawn from its own generator, seeded by the
run's seed and the tensor's name, so the checkpoint depends neither on the order in which a
library creates parameters nor on any global random state.  vLLM loads the directory as it
loads a downloaded model (tokenizer disabled: prompts are token ids).

:func:`load_model` builds the same architecture from a checkpoint directory with parameters in
a chosen dtype (fp32 master weights for training, bf16 for the frozen reference and for local
sampling).  Only the parameters take that dtype: the rotary embedding's inverse frequencies
stay fp32 buffers in every copy, so a bf16 model and an fp32 model run under a bf16
mixed-precision policy compute the same forward pass.

``transformers`` and ``safetensors`` are imported only when a function here runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dcr.errors import ConfigError
from dcr.rl.config import RLConfig
from dcr.rl.files import atomic_write, read_safetensors, write_safetensors
from dcr.rl.task import BOS, SEP

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "hf_config",
    "initial_state_dict",
    "load_model",
    "read_config_text",
    "read_weights",
    "write_checkpoint",
    "write_initial_checkpoint",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ATTENTION = "sdpa"
"""The attention kernel of every model built here (PyTorch's scaled-dot-product attention)."""


def hf_config(config: RLConfig) -> Any:
    """The ``transformers.Qwen3Config`` of ``config``'s model (bf16, untied embeddings)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=max(64, config.prompt_len + config.response_len),
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=BOS,
        eos_token_id=SEP,
        pad_token_id=None,
        initializer_range=config.init_std,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )


def _tensor_seed(seed: int, name: str) -> int:
    text = f"{int(seed)},{name}".encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"dcr-rl-init").digest()
    return int.from_bytes(digest) % (1 << 63)


def initial_state_dict(config: RLConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Version 0's weights in bf16, by checkpoint name: norm weights 1, every other tensor
    ``N(0, init_std)`` drawn in fp32 from a generator seeded by ``(seed, name)``."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        skeleton = Qwen3ForCausalLM(hf_config(config))
    out: dict[str, torch.Tensor] = {}
    for name, p in skeleton.named_parameters():
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * config.init_std
        out[name] = t.to(torch.bfloat16)
    return out


def write_checkpoint(
    directory: str | os.PathLike[str],
    config_json: str,
    state_dict: Mapping[str, torch.Tensor],
) -> Path:
    """A Hugging Face checkpoint directory: ``config_json`` as ``config.json`` and the
    tensors as one ``model.safetensors``, each file written atomically; returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS_FILE, state_dict, {"format": "pt"})
    atomic_write(out / CONFIG_FILE, config_json.encode())
    return out


def write_initial_checkpoint(
    directory: str | os.PathLike[str], *, seed: int, config: RLConfig | None = None
) -> Path:
    """Write version 0 of the policy (``config``'s model, weights seeded by ``seed``) as a
    bf16 Hugging Face checkpoint into ``directory``; returns the directory."""
    config = config or RLConfig()
    text = hf_config(config).to_json_string()
    return write_checkpoint(directory, text, initial_state_dict(config, seed=seed))


def read_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory's ``model.safetensors``, by name."""
    tensors, _ = read_safetensors(Path(directory) / WEIGHTS_FILE)
    return tensors


def read_config_text(directory: str | os.PathLike[str]) -> str:
    """A checkpoint directory's ``config.json`` text, checked to name ``Qwen3ForCausalLM``."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"no {CONFIG_FILE} in {os.fspath(directory)!r}", check="missing")
    text = path.read_text()
    if json.loads(text).get("architectures") != ["Qwen3ForCausalLM"]:
        raise ConfigError(f"{path} does not describe a Qwen3ForCausalLM", check="config")
    return text


def load_model(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """The checkpoint's ``Qwen3ForCausalLM`` on the CPU, parameters in ``dtype`` (the
    checkpoint's bf16 values converted exactly), buffers fp32, in eval mode (no dropout).

    ``state_dict`` replaces the checkpoint's weights (same names and shapes) -- the served
    weights of a later version, say.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config.from_dict(json.loads(read_config_text(directory)))
    config._attn_implementation = ATTENTION
    model = Qwen3ForCausalLM(config)
    weights = dict(state_dict) if state_dict is not None else read_weights(directory)
    own = dict(model.named_parameters())
    if set(own) != set(weights):
        missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        raise ConfigError(
            f"checkpoint tensors do not match the model: missing {missing[:3]}, "
            f"unexpected {extra[:3]}",
            check="name",
        )
    with torch.no_grad():
        for name, p in own.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ConfigError(
                    f"shape {tuple(w.shape)} != {tuple(p.shape)}", tensor=name, check="shape"
                )
            p.data = w.detach().to(dtype=dtype, copy=True).contiguous()
    model.eval()
    module: torch.nn.Module = model
    return module
