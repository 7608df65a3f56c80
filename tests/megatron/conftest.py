"""The Megatron tests run only where Megatron-Bridge is installed (`make test-megatron`, which
builds .venv-megatron with scripts/megatron-venv.sh)."""

from __future__ import annotations

import importlib.util


def _bridge_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        return False


collect_ignore_glob = [] if _bridge_installed() else ["test_*.py"]
