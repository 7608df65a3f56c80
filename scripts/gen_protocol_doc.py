"""Regenerate the parts of docs/protocol.md and models/refit.tla drawn from the edge table.

Usage: ``python scripts/gen_protocol_doc.py`` (``--check`` exits 1 instead of writing when a
file is stale).  The table is ``dcr.protocol.lifecycle.EDGES``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dcr.protocol.diagram import doc_blocks, replace_block, tla_edges

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"
SPEC = ROOT / "models" / "refit.tla"


def render_doc(text: str) -> str:
    for name, block in doc_blocks().items():
        text = replace_block(
            text, f"<!-- BEGIN GENERATED {name} -->", f"<!-- END GENERATED {name} -->", block
        )
    return text


def render_spec(text: str) -> str:
    return replace_block(text, "\\* BEGIN GENERATED EDGES", "\\* END GENERATED EDGES", tla_edges())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, render in ((DOC, render_doc), (SPEC, render_spec)):
        old = path.read_text()
        new = render(old)
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale: " + ", ".join(str(p.relative_to(ROOT)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
