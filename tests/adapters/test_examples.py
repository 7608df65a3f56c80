"""The third-party adapters of ``examples/`` pass dcr's conformance suites, as their authors
would run them; the suites catch broken versions of them; each example is a user's file
(under 100 lines, public dcr names only) and ``docs/api.md`` ("Writing an adapter") shows it
verbatim, together with the test classes below."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import anyio
import pytest
import torch

import dcr
from dcr.adapters.transport import Transport
from dcr.testing.loader import LoaderTests
from dcr.testing.transport import TransportTests

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from third_party_loader import TinyLM, TinyLMLoader  # noqa: E402
from third_party_transport import QueueTransport  # noqa: E402

# -- the suites, as the examples' authors run them ------------------------------------------


class TestQueueTransport(TransportTests):
    shared = True  # one object serves every process
    credit = False  # a send never waits for receivers

    async def make_transport(self) -> Transport:
        return QueueTransport()


class TestTinyLMLoader(LoaderTests):
    def make_loader(self) -> TinyLMLoader:
        return TinyLMLoader(TinyLM())

    def catalog(self) -> dict[str, dcr.TensorSpec]:
        return TinyLM.catalog()

    def repack(self, loader: dcr.Loader) -> bool:
        assert isinstance(loader, TinyLMLoader)
        loader.module.pack()
        return True


# -- the suites catch broken versions of the examples ---------------------------------------


class _IgnoresTo(QueueTransport):
    async def send(self, key, data, *, to=None):  # type: ignore[no-untyped-def]
        await super().send(key, data)  # every receiver gets every payload


class _TakesStoppedAttempts(QueueTransport):
    async def stop_and_wait(self, attempt: int) -> None:
        return None


class _Broken(TestQueueTransport):
    broken: type[QueueTransport]

    async def make_transport(self) -> Transport:
        return self.broken()


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (_IgnoresTo, "test_delivery_to_named_receivers"),
        (_TakesStoppedAttempts, "test_stop_and_wait"),
    ],
)
def test_the_transport_suite_catches_a_broken_transport(
    broken: type[QueueTransport], check: str
) -> None:
    suite = _Broken()
    suite.broken = broken
    with pytest.raises((AssertionError, ExceptionGroup)):
        anyio.run(getattr(suite, check), backend="asyncio")


class _FlipsBehindTheHook(TinyLMLoader):
    """Copies, then flips a stored bit through numpy, where dcr cannot see it."""

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        loaded = super().load_weights(weights)
        if "embed" in loaded:
            self.module.embed.detach().view(torch.int16).numpy()[0, 0] ^= 1
        return loaded


class _ZeroesBehindTheHook(TinyLMLoader):
    """Copies, then zeroes a stored element through numpy, where dcr cannot see it."""

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        loaded = super().load_weights(weights)
        if "embed" in loaded:
            self.module.embed.detach().view(torch.int16).numpy()[0, 0] = 0
        return loaded


class _PlacesByCallCount(TinyLMLoader):
    """Puts q into the rows of k every other call: its writes do not repeat."""

    calls = 0

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().load_weights(weights)

    def _load(self, name: str, w: torch.Tensor) -> str | None:
        if name.endswith("q_proj.weight") and self.calls % 2:
            name = name.replace("q_proj", "k_proj")
        return super()._load(name, w)


class _NeverRefuses(TinyLMLoader):
    def check_ready(self) -> None:
        return None


class _BrokenLoader(TestTinyLMLoader):
    broken: type[TinyLMLoader]

    def make_loader(self) -> TinyLMLoader:
        return self.broken(TinyLM())


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        (_ZeroesBehindTheHook, "test_preserving_paths_store_the_given_bits"),
        (_FlipsBehindTheHook, "test_prewarm_classifies_every_name_and_changes_nothing"),
        (_PlacesByCallCount, "test_each_attempt_witnesses_the_loader_once_per_name"),
        (_NeverRefuses, "test_repacked_weights_are_refused"),
    ],
)
def test_the_loader_suite_catches_a_broken_loader(broken: type[TinyLMLoader], check: str) -> None:
    suite = _BrokenLoader()
    suite.broken = broken
    with pytest.raises((AssertionError, dcr.DcrError, pytest.fail.Exception)):
        getattr(suite, check)()


# -- the examples are a user's files, and the documentation shows them -----------------------

PUBLIC = {
    "dcr": set(dcr.__all__),
    "dcr.errors": {"LoaderPathUnsupported", "TransportError"},
    "dcr.adapters.transport": {"Delivery", "Transport", "TransportStats"},
    "dcr.protocol.types": {"PayloadKey"},
}


@pytest.mark.parametrize("name", ["third_party_transport.py", "third_party_loader.py"])
def test_an_example_is_short_and_uses_public_names_only(name: str) -> None:
    source = (EXAMPLES / name).read_text()
    assert len(source.splitlines()) < 100
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("dcr") for a in node.names), ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dcr"):
            assert node.module in PUBLIC, node.module
            assert {a.name for a in node.names} <= PUBLIC[node.module], ast.unparse(node)


def _section() -> str:
    text = (ROOT / "docs" / "api.md").read_text()
    start = text.index("\n## Writing an adapter\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_documentation_shows_the_examples_and_their_tests_verbatim() -> None:
    blocks = re.findall(r"```python\n(.*?)```", _section(), re.S)
    files = {p.name: p.read_text() for p in EXAMPLES.glob("*.py")}
    here = Path(__file__).read_text()
    assert set(files) == {"third_party_transport.py", "third_party_loader.py"}
    for name, source in files.items():
        assert source in blocks, f"docs/api.md does not show examples/{name} as it is"
    for block in blocks:
        assert block in files.values() or block in here, f"not in the examples:\n{block}"
