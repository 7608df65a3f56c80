"""``import dcr.protocol`` must stay free of I/O and numeric libraries (docs/architecture.md,
"Layers")."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("anyio", "asyncio", "torch", "numpy", "zmq", "botocore", "aiobotocore", "trio")


def test_import_protocol_loads_only_stdlib_and_transitions() -> None:
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import dcr.protocol, dcr.protocol.diagram\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = json.loads(out)
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"import dcr.protocol pulled in {bad}"
    third_party = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names)
    assert third_party <= {"dcr", "transitions", "six"}, third_party  # six: used by transitions
    assert "dcr.protocol.coordinator" in loaded  # the check itself must see the package load
