"""Product layers never import test scaffolding, the in-process fleet, the demo, benchmarks or
the CLI (ARCHITECTURE.md §3, STYLE.md): checked on the source, every import statement of every
module, including those inside functions and ``TYPE_CHECKING`` blocks."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dcr"
PRODUCT = ("delta", "wire", "apply", "protocol", "engine", "adapters")
FORBIDDEN = ("dcr.testing", "dcr.local", "dcr.demo", "dcr.bench", "dcr.cli")


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


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f"{f}.") for f in FORBIDDEN)


def _product_modules() -> list[Path]:
    return sorted(p for layer in PRODUCT for p in (ROOT / layer).rglob("*.py"))


def test_the_scan_sees_every_layer() -> None:
    modules = {_module_name(p) for p in _product_modules()}
    for layer in PRODUCT:
        assert f"dcr.{layer}" in modules
    assert "dcr.engine.coordinator" in modules and "dcr.adapters.registry" in modules


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
        ("from dcr.delta.records import Item", "dcr.wire.x", False, False),
        ("from .records import Item", "dcr.delta.x", False, False),
    ],
)
def test_the_scan_catches_forbidden_imports(
    source: str, module: str, is_package: bool, bad: bool
) -> None:
    names = list(imported_modules(source, module, is_package=is_package))
    assert any(_forbidden(n) for n in names) is bad, names


def test_product_layers_import_no_scaffolding() -> None:
    offenders = [
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in _product_modules()
        for name in imported_modules(
            path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
        )
        if _forbidden(name)
    ]
    assert not offenders, "product layers import test scaffolding or entry points:\n" + "\n".join(
        offenders
    )
