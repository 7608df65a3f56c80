"""docs/protocol.md and models/refit.tla carry text generated from the edge table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from dcr.protocol.diagram import doc_blocks, mermaid, replace_block, tla_edges
from dcr.protocol.lifecycle import LIFECYCLES, edges_of

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_protocol_doc.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_doc_and_spec_are_up_to_date() -> None:
    gen = _generator()
    doc = (ROOT / "docs" / "protocol.md").read_text()
    tla = (ROOT / "models" / "refit.tla").read_text()
    assert gen.render_doc(doc) == doc, "docs/protocol.md is stale: run scripts/gen_protocol_doc.py"
    assert gen.render_spec(tla) == tla, "models/refit.tla is stale: run scripts/gen_protocol_doc.py"
    for block in doc_blocks().values():
        assert block in doc
    assert tla_edges() in tla


def test_diagram_draws_every_edge() -> None:
    for lc in LIFECYCLES:
        text = mermaid(lc)
        assert text.startswith("stateDiagram-v2")
        for e in edges_of(lc):  # type: ignore[type-var]
            assert f"{e.source.value} --> {e.dest.value}: {e.trigger.value}" in text


def test_replace_block_detects_a_stale_file() -> None:
    text = "a\n<!-- B -->\nold\n<!-- E -->\nz\n"
    assert (
        replace_block(text, "<!-- B -->", "<!-- E -->", "new")
        == "a\n<!-- B -->\nnew\n<!-- E -->\nz\n"
    )


def test_every_message_event_and_command_is_documented() -> None:
    from dcr.protocol import commands, events, messages

    doc = (ROOT / "docs" / "protocol.md").read_text()
    for module in (messages, events, commands):
        for name in module.__all__:
            aggregate = name in (
                "Command", "Message", "Reply", "CoordinatorEvent", "OwnerEvent",
                "ReceiverEvent", "CoordinatorCommand", "OwnerCommand", "ReceiverCommand",
            )  # fmt: skip
            if name[0].isupper() and not name.isupper() and not aggregate:
                assert f"`{name}(" in doc or f"`{name}`" in doc, f"{name} is not documented"
