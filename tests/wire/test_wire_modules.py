"""``dcr.wire.payload`` stays the one-import facade over the format, the encoder and the strict
decoder, and the three modules import each other only one way (format <- encode, decode)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dcr.wire import decode, encode, payload
from dcr.wire import format as fmt

PUBLIC = {
    "CODEC_ZSTD": fmt,
    "DEFAULT_LAYOUT": fmt,
    "DEFAULT_LEVEL": fmt,
    "DIGEST_SIZE": fmt,
    "FLAG_FINAL": fmt,
    "FORMAT_VERSION": fmt,
    "HEADER_SIZE": fmt,
    "MAGIC": fmt,
    "SUPPORTED_VERSIONS": fmt,
    "DecodeLimits": fmt,
    "Items": fmt,
    "Payload": fmt,
    "PayloadHeader": fmt,
    "ValueLayout": fmt,
    "decode_payload": decode,
    "encode_bucket": encode,
    "encode_payload": encode,
    "read_header": decode,
}


def test_facade_reexports_the_same_objects() -> None:
    assert sorted(payload.__all__) == sorted(PUBLIC)
    for name, home in PUBLIC.items():
        assert getattr(payload, name) is getattr(home, name), name


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("dcr.wire.format", {"dcr.wire.encode", "dcr.wire.decode", "dcr.wire.payload"}),
        ("dcr.wire.decode", {"dcr.wire.encode", "dcr.wire.payload"}),
        ("dcr.wire.encode", {"dcr.wire.decode", "dcr.wire.payload"}),
    ],
)
def test_each_module_imports_on_its_own(module: str, absent: set[str]) -> None:
    # ``dcr.wire``'s package ``__init__`` loads all of them, so look below it: import the
    # module's file alone, with the package body skipped.
    code = (
        "import importlib, json, sys, types\n"
        "pkg = types.ModuleType('dcr.wire')\n"
        "import dcr\n"
        "pkg.__path__ = [dcr.__path__[0] + '/wire']\n"
        "sys.modules['dcr.wire'] = pkg\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dcr.wire.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    loaded = set(json.loads(out))
    assert module in loaded
    assert not loaded & absent, loaded & absent
