"""One registry of adapter implementations, imported lazily by name.

Each kind of adapter maps a short name to a target ``"package.module:attr"``.  Names come from
two places:

* dcr's own adapters, registered below with :func:`register` (plus an install hint for those
  that need an optional vendor library);
* Python entry points of other distributions, one group per kind (:data:`GROUPS`), read once
  per group the first time that kind is looked up.  A package plugs in a transport with, in
  its ``pyproject.toml``::

      [project.entry-points."dcr.transports"]
      mystore = "mypkg.transport:MyTransport"

Choosing an adapter by name imports only its own module, so no vendor library that is not
needed is imported, and a missing one fails with a :class:`~dcr.errors.ConfigError` that says
what to install.  A name given twice -- by dcr and an entry point, or by two distributions --
is ambiguous and refused with both targets named.  Where a name is expected,
``"package.module:attr"`` itself is accepted too, so a fleet file can name a factory of the
user's own without packaging it.

:func:`load` returns a class (transports, commit stores, control channels, loaders);
:func:`load_factory` returns any callable (trainers and receiver runtimes are factories).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dcr.errors import ConfigError

__all__ = [
    "GROUPS",
    "AdapterSpec",
    "available",
    "clear_entry_points",
    "group",
    "load",
    "load_factory",
    "register",
    "resolve",
]

GROUPS: Mapping[str, str] = MappingProxyType(
    {
        "transport": "dcr.transports",
        "commit_store": "dcr.commit_stores",
        "control": "dcr.control",
        "loader": "dcr.loaders",
        "trainer": "dcr.trainers",
        "receiver": "dcr.receivers",
    }
)
"""Each kind of adapter and the entry-point group other distributions register it in."""

BUILTIN = "dcr"
"""The origin of the adapters registered by dcr itself."""

_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSpec:
    """Where an adapter lives, what to install when its import fails, and who named it."""

    kind: str
    name: str
    target: str
    install: str | None = None
    origin: str = BUILTIN
    """``dcr`` for built-in adapters, else the distribution whose entry point names it (or
    the target itself, for a ``module:attr`` given directly)."""

    def describe(self) -> str:
        """The target and where it was registered, for messages."""
        if self.origin == BUILTIN:
            return f"{self.target!r} (built into dcr)"
        if self.origin == self.target:
            return f"{self.target!r}"
        return f"{self.target!r} (entry point of {self.origin}, group {GROUPS[self.kind]})"


_BUILTINS: dict[tuple[str, str], AdapterSpec] = {}
_ENTRY_POINTS: dict[str, dict[str, list[AdapterSpec]]] = {}
"""Entry points read so far, by kind and name (several specs: a conflict)."""
_LOCK = threading.Lock()


def group(kind: str) -> str:
    """The entry-point group of ``kind``; :class:`ConfigError` for an unknown kind."""
    try:
        return GROUPS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown adapter kind {kind!r}; kinds: {', '.join(sorted(GROUPS))}"
        ) from None


def _is_target(value: str) -> bool:
    return ":" in value


def _check_target(target: str, where: str) -> None:
    if not _TARGET.match(target):
        raise ConfigError(f"{where}: {target!r} must look like 'package.module:attr'")


def register(kind: str, name: str, target: str, *, install: str | None = None) -> None:
    """Register ``target`` (``"package.module:attr"``) as adapter ``name`` of ``kind``.

    For dcr's own adapters and for code that registers adapters at run time; distributions
    use entry points instead.  Registering a name twice raises :class:`ConfigError`.
    """
    group(kind)
    _check_target(target, f"the {kind} {name!r}")
    if not name or _is_target(name):
        raise ConfigError(f"a {kind} name must be non-empty and hold no ':', got {name!r}")
    spec = AdapterSpec(kind=kind, name=name, target=target, install=install)
    with _LOCK:
        key = (kind, name)
        if key in _BUILTINS:
            raise ConfigError(
                f"a {kind} named {name!r} is already registered: "
                f"{_BUILTINS[key].describe()}, now {spec.describe()}"
            )
        others = [s for s in _ENTRY_POINTS.get(kind, {}).get(name, []) if s.target != target]
        if others:
            raise ConfigError(_conflict(kind, name, [spec, *others]))
        _BUILTINS[key] = spec


def clear_entry_points() -> None:
    """Forget the entry points read so far: the next lookup of each kind reads its group
    again (after distributions were installed or ``sys.path`` changed)."""
    with _LOCK:
        _ENTRY_POINTS.clear()


def _entry_points(kind: str) -> dict[str, list[AdapterSpec]]:
    """The entry points of ``kind``'s group, by name, read on first use."""
    with _LOCK:
        found = _ENTRY_POINTS.get(kind)
        if found is not None:
            return found
        found = {}
        for ep in importlib.metadata.entry_points(group=group(kind)):
            dist = getattr(ep, "dist", None)
            origin = f"distribution {dist.name}" if dist is not None else "an unnamed distribution"
            target = ep.value.split("[", 1)[0].replace(" ", "")
            spec = AdapterSpec(kind=kind, name=ep.name, target=target, origin=origin)
            same = found.setdefault(ep.name, [])
            if all(s.target != target for s in same):
                same.append(spec)
        _ENTRY_POINTS[kind] = found
        return found


def _conflict(kind: str, name: str, specs: list[AdapterSpec]) -> str:
    return (
        f"the {kind} name {name!r} is registered more than once: "
        + " and ".join(s.describe() for s in specs)
        + "; uninstall one of them, or name the one you mean as 'package.module:attr'"
    )


def available(kind: str) -> list[str]:
    """Names of ``kind``, built-in and from entry points, sorted."""
    names = {name for k, name in _BUILTINS if k == kind}
    return sorted(names | set(_entry_points(kind)))


def _available_text(kind: str) -> str:
    return (
        f"available: {', '.join(available(kind)) or '-'} "
        f"(entry points of group {group(kind)} add more)"
    )


def resolve(kind: str, name: str) -> AdapterSpec:
    """Where adapter ``name`` of ``kind`` lives, without importing it.

    ``name`` is a registered name or a target ``"package.module:attr"``.  Raises
    :class:`ConfigError` for an unknown kind or name, a malformed target, and a name that
    several registrations give.
    """
    group(kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{kind}.kind must be a name or 'package.module:attr', got {name!r}")
    if _is_target(name):
        _check_target(name, f"{kind}.kind")
        return AdapterSpec(kind=kind, name=name, target=name, origin=name)
    builtin = _BUILTINS.get((kind, name))
    plugins = _entry_points(kind).get(name, [])
    specs = ([builtin] if builtin is not None else []) + [
        s for s in plugins if builtin is None or s.target != builtin.target
    ]
    if not specs:
        raise ConfigError(f"no {kind} named {name!r}; {_available_text(kind)}")
    if len(specs) > 1:
        raise ConfigError(_conflict(kind, name, specs))
    return specs[0]


def _import(spec: AdapterSpec) -> Any:
    _check_target(spec.target, f"the {spec.kind} {spec.name!r} ({spec.origin})")
    module, _, attr = spec.target.partition(":")
    try:
        value: Any = importlib.import_module(module)
        for part in attr.split("."):
            value = getattr(value, part)
    except Exception as exc:  # a third party's import may fail in any way
        named = "" if spec.origin == spec.target else f" ({spec.kind} {spec.name!r})"
        missing = isinstance(exc, ImportError)
        hint = f"; install it with: {spec.install}" if spec.install and missing else ""
        raise ConfigError(
            f"cannot import {spec.target!r}{named} named by {spec.kind}.kind: "
            f"{type(exc).__name__}: {exc}{hint}"
        ) from exc
    return value


def load(kind: str, name: str) -> type:
    """Import and return the class named ``name`` (registered, or ``"package.module:Class"``)
    of ``kind``; :class:`ConfigError` when there is none, it cannot be imported, or it is
    not a class."""
    spec = resolve(kind, name)
    value = _import(spec)
    if not isinstance(value, type):
        raise ConfigError(
            f"{kind}.kind {name!r} names {spec.target!r}, an object of type "
            f"{type(value).__name__}, not a class"
        )
    return value


def load_factory(kind: str, name: str) -> Callable[..., Any]:
    """Import and return the callable named ``name`` of ``kind``: a class or a function
    that builds the adapter (trainers, receiver runtimes)."""
    spec = resolve(kind, name)
    value = _import(spec)
    if not callable(value):
        raise ConfigError(
            f"{kind}.kind {name!r} names {spec.target!r}, an object of type "
            f"{type(value).__name__}, not a class or function"
        )
    factory: Callable[..., Any] = value
    return factory


for _kind, _name, _target, _install in (
    ("commit_store", "memory", "dcr.adapters.commit.memory:MemoryCommitStore", None),
    ("commit_store", "sqlite", "dcr.adapters.commit.sqlite:SqliteCommitStore", None),
    ("commit_store", "s3", "dcr.adapters.commit.s3:S3CommitStore", "pip install 'dcr[s3]'"),
    ("control", "memory", "dcr.adapters.control.memory:MemoryControl", None),
    ("control", "zmq", "dcr.adapters.control.zmq:ZmqControl", "pip install 'dcr[zmq]'"),
    ("loader", "torch", "dcr.adapters.loaders.torch_module:TorchModuleLoader", None),
    ("loader", "sharded", "dcr.adapters.loaders.sharded:ShardedServingLoader", None),
    ("loader", "vllm", "dcr.adapters.loaders.vllm:VllmLoader", "pip install 'dcr[vllm]'"),
    ("transport", "memory", "dcr.adapters.transport.memory:MemoryTransport", None),
    ("transport", "directory", "dcr.adapters.transport.directory:DirectoryTransport", None),
    ("transport", "s3", "dcr.adapters.transport.s3:S3Transport", "pip install 'dcr[s3]'"),
    ("transport", "relay", "dcr.adapters.transport.relay:RelayTransport", "pip install 'dcr[zmq]'"),
    ("trainer", "synthetic", "dcr.fleet.owner:synthetic_trainer", None),
    ("trainer", "fsdp", "dcr.rl.fleet:fsdp_trainer", "pip install 'dcr[rl]'"),
    ("receiver", "sharded", "dcr.fleet.receiver:sharded_runtime", None),
    ("receiver", "torch", "dcr.fleet.receiver:torch_runtime", None),
):
    register(_kind, _name, _target, install=_install)
