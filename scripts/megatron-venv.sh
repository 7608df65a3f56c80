#!/usr/bin/env bash
# Create or update .venv-megatron: Megatron-Core and Megatron-Bridge on CPU, plus dcr (editable)
# and its test tools.
#
# megatron-bridge 0.6.2 and megatron-core 0.19.2 declare Python >= 3.12, yet the parts dcr uses
# (model construction on CPU with gloo, the mapping registry, export_hf_weights) run on 3.11.
# They are installed without their dependency lists (which pull CUDA-only packages) plus what
# construction and mapping need; `import megatron.core` needs triton, which imports without a GPU.
# Two shims make the Bridge importable there; they live in this virtualenv only, loaded by a .pth
# file at interpreter start (dcr itself contains none):
#   * typing.override (new in 3.12) is taken from typing_extensions;
#   * megatron.bridge.peft.lora_layers imports transformer_engine unconditionally: while
#     transformer_engine is absent, that one module resolves to a stub whose classes match
#     nothing (LoRA layers cannot exist without it).
# A stamp file records what was installed; when it matches, only the editable dcr install is
# refreshed, so running this again costs a few seconds.
set -euo pipefail

cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${VENV_MEGATRON:-.venv-megatron}"
STAMP="$VENV/.dcr-megatron-stamp"
NODEPS=(megatron-core==0.19.2 megatron-bridge==0.6.2)
DEPS=(torch==2.13.0 "transformers==5.12.1" triton einops omegaconf pyyaml tqdm rich regex six
      packaging typing_extensions safetensors numpy zstandard anyio transitions msgspec blake3
      pytest pytest-timeout pytest-asyncio pytest-xdist hypothesis)
SHIMS=2
WANT="nodeps=${NODEPS[*]} deps=${DEPS[*]} shims=$SHIMS"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --quiet)

pip_() {
    # pip warns once per package about index locations that do not exist here; drop that noise.
    "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "$VENV is up to date (${NODEPS[*]})"
else
    echo "installing ${NODEPS[*]} into $VENV (a minute or two on a fresh venv)"
    pip_ install "${DEPS[@]}"
    pip_ install --no-deps --ignore-requires-python "${NODEPS[@]}"
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cat > "$SITE/dcr_megatron_shims.py" <<'EOF'
"""Shims that let Megatron-Bridge 0.6.2 import on Python 3.11 without transformer_engine.

Installed by dcr's scripts/megatron-venv.sh into this virtualenv only (see that script).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing

import typing_extensions

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override

_STUB = "megatron.bridge.peft.lora_layers"


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        classes: dict[str, type] = {}

        def __getattr__(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            if name not in classes:
                classes[name] = type(name, (), {"__module__": _STUB})
            return classes[name]

        module.__getattr__ = __getattr__


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _STUB or importlib.util.find_spec("transformer_engine") is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader())


sys.meta_path.insert(0, _StubFinder())
EOF
    echo "import dcr_megatron_shims" > "$SITE/dcr_megatron_shims.pth"
    rm -f "$STAMP"
fi

# dcr itself: editable, without resolving its dependencies again (they are all above).
scripts/editable-install.sh "$VENV/bin/python" . --no-deps

# Fail here, not in the tests, if the environment is not what they need.
HF_HUB_OFFLINE=1 "$VENV/bin/python" -W ignore - <<'EOF'
import logging

logging.disable(logging.WARNING)
import importlib.metadata as md

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("megatron-core") == "0.19.2", md.version("megatron-core")
assert md.version("megatron-bridge") == "0.6.2", md.version("megatron-bridge")
import megatron.core  # noqa: F401
from megatron.bridge import AutoBridge  # noqa: F401

import dcr  # noqa: F401
EOF

echo "$WANT" > "$STAMP"
