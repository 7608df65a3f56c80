"""Suite-wide settings and fixtures.

The vLLM tests run only in their own virtualenv (`make test-vllm`).  ``numpy_path`` runs a test
with dcr's C kernels disabled (the numpy implementations they must agree with); modules that
set ``pytestmark = pytest.mark.usefixtures("both_paths")`` run every test on both.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

import dcr.native
from dcr.ray.netns import only_loopback


def _vllm_installed() -> bool:
    # ``tests/vllm`` itself is importable as a namespace package ``vllm`` (no origin).
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


# The Ray suite runs only in a private network namespace with loopback alone (`make test-ray`);
# the RL loop's Ray runs (tests/vllm) enter one of their own.
collect_ignore = ([] if _vllm_installed() else ["vllm"]) + ([] if only_loopback() else ["ray"])


@pytest.fixture
def numpy_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The data plane without its C kernels (numpy everywhere)."""
    monkeypatch.setattr(dcr.native, "kernels", None)
    yield


_PATHS = ["native", "numpy"] if dcr.native.kernels is not None else ["numpy"]


@pytest.fixture(params=_PATHS)
def both_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run once with the C kernels (where built) and once with numpy only."""
    if request.param == "numpy":
        monkeypatch.setattr(dcr.native, "kernels", None)
    yield request.param
