"""The product never imports its test scaffolding, and the lower layers never import the layers
above them (docs/architecture.md, "Layers"): checked on the source, every import statement of
every module, including those inside functions and ``TYPE_CHECKING`` blocks, and every string
that names a module (adapter registry targets, lazy exports)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dcr"
LOWER = ("delta", "wire", "apply", "protocol", "engine", "adapters")
FORBIDDEN = ("dcr.testing", "dcr.local", "dcr.demo", "dcr.bench", "dcr.cli", "dcr.fleet", "dcr.rl")
"""What the lower layers never import."""
SCAFFOLDING = "dcr.testing"
"""What no product module imports: every module under ``dcr/`` but ``dcr/testing/``."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, *, is_package: bool = False) -> Iterator[str]:
    """Every module an import statement in ``source`` (the code of ``module``) names.

    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule); relative imports
    are resolved against ``module``'s package.
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(f"{prefix}.")


def _forbidden(name: str) -> bool:
    return any(_under(name, f) for f in FORBIDDEN)


def _lower_modules() -> list[Path]:
    return sorted(p for layer in LOWER for p in (ROOT / layer).rglob("*.py"))


def _product_modules() -> list[Path]:
    """Every module of the package but the test scaffolding (``dcr/testing/``)."""
    testing = ROOT / "testing"
    return sorted(p for p in ROOT.rglob("*.py") if testing not in p.parents)


def named_modules(source: str) -> Iterator[str]:
    """Module paths named in string constants: ``"dcr.x.y"`` or ``"dcr.x.y:Attr"`` (registry
    targets, lazy exports, ``importlib`` calls), docstrings left out."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            for word in node.value.replace(",", " ").split():
                word = word.strip("'\"`()")
                if word.startswith("dcr."):
                    yield word.partition(":")[0]


def test_the_scan_sees_every_layer() -> None:
    modules = {_module_name(p) for p in _lower_modules()}
    for layer in LOWER:
        assert f"dcr.{layer}" in modules
    assert "dcr.engine.coordinator" in modules and "dcr.adapters.registry" in modules
    product = {_module_name(p) for p in _product_modules()}
    assert {"dcr", "dcr.local", "dcr.fleet.owner", "dcr.bench.refit", "dcr.models"} <= product
    assert not any(_under(m, SCAFFOLDING) for m in product)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "bad"),
    [
        ("import dcr.testing.models", "dcr.delta.x", False, True),
        ("from dcr.testing.models import tiny_config", "dcr.delta.x", False, True),
        ("from dcr import local", "dcr.engine.x", False, True),
        ("def f():\n    from dcr.bench import codec", "dcr.wire.x", False, True),
        ("from ..testing import faults", "dcr.apply.x", False, True),
        ("from ...cli import main", "dcr.adapters.loaders.x", False, True),
        ("from . import demo", "dcr", True, True),
        ("from dcr.testingx import y", "dcr.delta.x", False, False),
        ("from dcr.tensors.records import Item", "dcr.wire.x", False, False),
        ("from .records import Item", "dcr.delta.x", False, False),
    ],
)
def test_the_scan_catches_forbidden_imports(
    source: str, module: str, is_package: bool, bad: bool
) -> None:
    names = list(imported_modules(source, module, is_package=is_package))
    assert any(_forbidden(n) for n in names) is bad, names


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ('X = ("loader", "reference", "dcr.testing.reference:Loader")', ["dcr.testing.reference"]),
        ('_EXPORTS = {"Faults": "dcr.testing.faults"}', ["dcr.testing.faults"]),
        ('def f():\n    """Uses dcr.testing.cluster."""', []),
        ('"""See dcr.testing.spec."""', []),
        ("import_module('dcr.testing.models')", ["dcr.testing.models"]),
    ],
)
def test_the_scan_reads_module_names_in_strings(source: str, names: list[str]) -> None:
    assert list(named_modules(source)) == names


def test_lower_layers_import_no_upper_layer() -> None:
    offenders = [
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in _lower_modules()
        for name in imported_modules(
            path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
        )
        if _forbidden(name)
    ]
    assert not offenders, "lower layers import upper layers or test scaffolding:\n" + "\n".join(
        offenders
    )


def test_no_product_module_imports_the_test_scaffolding() -> None:
    offenders = []
    for path in _product_modules():
        source = path.read_text()
        module = _module_name(path)
        imported = imported_modules(source, module, is_package=path.name == "__init__.py")
        for name in [*imported, *named_modules(source)]:
            if _under(name, SCAFFOLDING):
                offenders.append(f"{path.relative_to(ROOT.parent)}: {name}")
    assert not offenders, "product modules use dcr.testing:\n" + "\n".join(offenders)


# -- the whole order -------------------------------------------------------------------------

ORDER: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("_kernels", "native", "ports", "alloc", "files", "metrics", "protocol"),
    ("tensors",),
    ("delta", "wire"),
    ("apply", "models"),
    ("catalog", "adapters"),
    ("engine",),
    ("local", "fleet"),
    ("integrations", "rl", "bench", "demo", "ray"),
    ("cli",),
    ("",),
)
"""Every product module by layer, lowest first (docs/architecture.md, "Layers"): a module
imports its own package and the layers below it, never its neighbours in the same layer nor
anything above.  ``""`` is the package itself (its lazy exports name every layer)."""
ALLOWED = {("catalog", "apply"), ("integrations", "fleet"), ("rl", "fleet"), ("bench", "fleet"),
           ("demo", "fleet"), ("integrations", "local"), ("ray", "fleet"),
           ("ray", "integrations"), ("rl", "ray"), ("bench", "ray")}  # fmt: skip
"""Imports between neighbours that the order allows (an upper part of a layer on a lower)."""


def _part(name: str) -> str:
    """The top-level part of ``dcr`` a module belongs to: ``dcr.fleet.owner`` -> ``fleet``."""
    return name.split(".")[1] if name.count(".") else ""


def _rank(part: str) -> int:
    for rank, layer in enumerate(ORDER):
        if part in layer:
            return rank
    raise AssertionError(f"dcr.{part} is in no layer of tests/test_layers.py ORDER")


def test_every_product_module_has_a_layer() -> None:
    for path in _product_modules():
        _rank(_part(_module_name(path)))
    assert {p for layer in ORDER for p in layer} >= {
        _part(_module_name(p)) for p in _product_modules()
    }


def test_every_module_imports_only_its_package_and_the_layers_below() -> None:
    offenders = []
    for path in _product_modules():
        module = _module_name(path)
        mine = _part(module)
        package = path.name == "__init__.py"
        for name in imported_modules(path.read_text(), module, is_package=package):
            if not _under(name, "dcr") or name == "dcr" or _under(name, SCAFFOLDING):
                continue  # third party; ``from dcr import x`` names dcr.x as well
            theirs = _part(name)
            if not any((ROOT / theirs).with_suffix(x).exists() for x in (".py", ".c", "")):
                continue  # an attribute of the package (``from dcr import __version__``)
            if theirs == mine or (mine, theirs) in ALLOWED or _rank(theirs) < _rank(mine):
                continue
            offenders.append(f"{path.relative_to(ROOT.parent)}: {name}")
    assert not offenders, "imports against the layer order:\n" + "\n".join(offenders)


def test_every_module_opens_with_the_concept_it_holds() -> None:
    """A newcomer reads a module's docstring first: every module of the package has one."""
    bare = [
        str(path.relative_to(ROOT.parent))
        for path in sorted(ROOT.rglob("*.py"))
        if len((ast.get_docstring(ast.parse(path.read_text())) or "").split()) < 5
    ]
    assert not bare, f"modules without an opening docstring: {bare}"
