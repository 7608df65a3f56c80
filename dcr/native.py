"""The optional C kernels of the data plane (``dcr._kernels``), or ``None``.

Construction's changed-element scan, payload format 2's Rice splitting, the receiver's
read-modify-write and the proof's fingerprint of stored views run in C when the extension
was built (``pip install`` compiles it where a C compiler is available) and in numpy
otherwise; both give identical results, which the tests check on every width and edge case.
``DCR_NATIVE=0`` in the environment disables the kernels (to compare, or to rule them
out).  :func:`require` fails loudly where they must be present (``make test`` sets
``DCR_REQUIRE_NATIVE=1``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from dcr.errors import ConfigError

__all__ = ["SCAN_KIND", "available", "kernels", "require"]

kernels: ModuleType | None
"""The ``dcr._kernels`` module, or ``None`` when it is not built or is disabled."""

_loaded: ModuleType | None
try:
    _loaded = importlib.import_module("dcr._kernels")
except ImportError:  # built without a C compiler: numpy paths
    _loaded = None

kernels = None if os.environ.get("DCR_NATIVE", "1") == "0" else _loaded

SCAN_KIND = {"xor": 0, "ulp": 1, "new": 2, "xor+new": 3}
"""``kind`` argument of ``kernels.scan``: the values gathered at changed positions."""


def available() -> bool:
    """Whether the C kernels are in use in this process."""
    return kernels is not None


def require() -> None:
    """Raise :class:`ConfigError` if the C kernels are not in use."""
    if kernels is None:
        why = "disabled by DCR_NATIVE=0" if _loaded is not None else "not built"
        raise ConfigError(
            f"dcr's C kernels are {why}; reinstall dcr with a C compiler available "
            "(pip install -e . builds dcr._kernels)",
            check="native",
        )
