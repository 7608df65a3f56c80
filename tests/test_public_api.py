"""``import dcr``: a curated, lazily imported public API that never pulls in vendor libraries
(docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import dcr

VENDORS = ("vllm", "zmq", "botocore", "aiobotocore", "megatron")


def _vendors_after(code: str) -> dict[str, list[str]]:
    """Run ``code`` in a fresh interpreter; which vendor modules each stage left loaded."""
    script = (
        "import json, sys\n"
        f"VENDORS = {VENDORS!r}\n"
        "def loaded():\n"
        "    return sorted({m.split('.')[0] for m in sys.modules} & set(VENDORS))\n"
        "stages = {}\n"
        f"{code}\n"
        "print(json.dumps(stages))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    result: dict[str, list[str]] = json.loads(out)
    return result


def test_import_dcr_and_every_public_name_load_no_vendor_library() -> None:
    # VllmLoader included: vLLM is imported inside its functions only.
    stages = _vendors_after(
        "import dcr\n"
        "stages['import dcr'] = loaded()\n"
        "for name in dcr.__all__:\n"
        "    getattr(dcr, name)\n"
        "stages['every public name'] = loaded()\n"
    )
    assert stages == {"import dcr": [], "every public name": []}


def test_every_public_name_resolves() -> None:
    for name in dcr.__all__:
        value = getattr(dcr, name)
        assert value is not None, name
        if isinstance(value, type):
            assert value.__name__ == name, name
    assert set(dir(dcr)) == set(dcr.__all__)


def test_added_exports_come_from_their_modules() -> None:
    from dcr.adapters.faulty import FaultReport
    from dcr.adapters.loaders.vllm import VllmLoader
    from dcr.delta.dist import DistTrainingGroup
    from dcr.delta.group import LocalTrainingGroup, TrainingGroup
    from dcr.protocol.receiver import QueueConfig
    from dcr.protocol.types import Timeouts

    assert dcr.Timeouts is Timeouts
    assert dcr.QueueConfig is QueueConfig
    assert dcr.FaultReport is FaultReport
    assert dcr.TrainingGroup is TrainingGroup
    assert dcr.LocalTrainingGroup is LocalTrainingGroup
    assert dcr.DistTrainingGroup is DistTrainingGroup
    assert issubclass(dcr.LocalTrainingGroup, dcr.TrainingGroup)
    assert issubclass(dcr.DistTrainingGroup, dcr.TrainingGroup)
    assert dcr.VllmLoader is VllmLoader
    assert issubclass(dcr.VllmLoader, dcr.Loader)


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NotAName"):
        dcr.NotAName  # noqa: B018
