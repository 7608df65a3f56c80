"""Text drawn from the edge table: Mermaid state diagrams and the TLA+ edge sets.

Pure functions from :data:`~dcr.protocol.lifecycle.EDGES` to text; ``scripts/gen_protocol_doc.py``
writes the results between markers in ``docs/protocol.md`` and ``models/refit.tla``, and a
test fails when the committed files drift from the table.
"""

from __future__ import annotations

import re

from dcr.protocol.lifecycle import EDGES, INITIAL_PHASES, LIFECYCLES, AnyEdge, Phase

__all__ = ["doc_blocks", "mermaid", "replace_block", "tla_edges"]

_TLA_NAMES = {
    "TransitionPhase": "TransitionEdges",
    "AttemptPhase": "AttemptEdges",
    "OwnerPhase": "OwnerEdges",
    "ReceiverPhase": "ReceiverEdges",
}


def _rows(lifecycle: type[Phase]) -> list[AnyEdge]:
    return [e for e in EDGES if type(e.source) is lifecycle]


def mermaid(lifecycle: type[Phase]) -> str:
    """A Mermaid ``stateDiagram-v2`` of one lifecycle, edges in table order."""
    rows = _rows(lifecycle)
    lines = ["stateDiagram-v2", f"    [*] --> {INITIAL_PHASES[lifecycle].value}"]
    lines += [f"    {e.source.value} --> {e.dest.value}: {e.trigger.value}" for e in rows]
    sources = {e.source for e in rows}
    ends = sorted(p.value for p in lifecycle if p not in sources)
    lines += [f"    {p} --> [*]" for p in ends]
    return "\n".join(lines)


def doc_blocks() -> dict[str, str]:
    """Marker name -> fenced Mermaid block, one per lifecycle."""
    return {lc.__name__: f"```mermaid\n{mermaid(lc)}\n```" for lc in LIFECYCLES}


def tla_edges() -> str:
    """The four edge sets as TLA+ definitions of ``<<source, trigger, dest>>`` triples."""
    parts = []
    for lc in LIFECYCLES:
        rows = ",\n".join(
            f'    <<"{e.source.value}", "{e.trigger.value}", "{e.dest.value}">>' for e in _rows(lc)
        )
        parts.append(f"{_TLA_NAMES[lc.__name__]} == {{\n{rows}\n}}")
    return "\n\n".join(parts)


def replace_block(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with everything between the lines ``begin`` and ``end`` replaced by ``body``."""
    pattern = re.compile(rf"(^{re.escape(begin)}\n).*?(^{re.escape(end)}$)", re.S | re.M)
    if not pattern.search(text):
        raise ValueError(f"markers {begin!r} ... {end!r} not found")
    return pattern.sub(lambda m: f"{m.group(1)}{body}\n{m.group(2)}", text, count=1)
