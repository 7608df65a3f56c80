"""Suite-wide settings: the vLLM tests run only in their own virtualenv (`make test-vllm`)."""

from __future__ import annotations

import importlib.util


def _vllm_installed() -> bool:
    # ``tests/vllm`` itself is importable as a namespace package ``vllm`` (no origin).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


collect_ignore = [] if _vllm_installed() else ["vllm"]
