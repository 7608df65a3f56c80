"""One registry of adapter implementations, imported lazily by short name.

Each kind of adapter (``transport``, ``commit_store``, ``control``, ``loader``) maps a short
name to ``"module:Class"`` plus an install hint, so that choosing an adapter by name never
imports a vendor library that is not needed, and a missing one fails with a clear message.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from dcr.errors import ConfigError

__all__ = ["AdapterSpec", "available", "load", "register"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterSpec:
    """Where an adapter lives and what to install when its import fails."""

    kind: str
    name: str
    target: str
    install: str | None = None


_REGISTRY: dict[tuple[str, str], AdapterSpec] = {}


def register(kind: str, name: str, target: str, *, install: str | None = None) -> None:
    """Register ``target`` (``"package.module:Class"``) as adapter ``name`` of ``kind``.

    Registering a name twice raises :class:`ConfigError`.
    """
    if ":" not in target:
        raise ConfigError(f"adapter target {target!r} must look like 'package.module:Class'")
    key = (kind, name)
    if key in _REGISTRY:
        raise ConfigError(f"a {kind} adapter named {name!r} is already registered")
    _REGISTRY[key] = AdapterSpec(kind=kind, name=name, target=target, install=install)


def available(kind: str) -> list[str]:
    """Registered names of ``kind``, sorted."""
    return sorted(name for k, name in _REGISTRY if k == kind)


def load(kind: str, name: str) -> type:
    """Import and return the class registered as ``name`` of ``kind``."""
    spec = _REGISTRY.get((kind, name))
    if spec is None:
        raise ConfigError(
            f"no {kind} adapter named {name!r}; available: {', '.join(available(kind)) or '-'}"
        )
    module, _, attr = spec.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        hint = f" (install it with: {spec.install})" if spec.install else ""
        raise ConfigError(f"the {kind} adapter {name!r} cannot be imported{hint}: {exc}") from exc
    if not isinstance(cls, type):
        raise ConfigError(f"{spec.target} is not a class")
    return cls


for _kind, _name, _target, _install in (
    ("commit_store", "memory", "dcr.adapters.commit.memory:MemoryCommitStore", None),
    ("commit_store", "sqlite", "dcr.adapters.commit.sqlite:SqliteCommitStore", None),
    ("commit_store", "s3", "dcr.adapters.commit.s3:S3CommitStore", "pip install 'dcr[s3]'"),
    ("control", "memory", "dcr.adapters.control.memory:MemoryControl", None),
    ("control", "zmq", "dcr.adapters.control.zmq:ZmqControl", "pip install 'dcr[zmq]'"),
    ("loader", "torch", "dcr.adapters.loaders.torch_module:TorchModuleLoader", None),
    ("loader", "reference", "dcr.adapters.loaders.reference:ShardedReferenceLoader", None),
    ("loader", "vllm", "dcr.adapters.loaders.vllm:VllmLoader", "pip install 'dcr[vllm]'"),
    ("transport", "memory", "dcr.adapters.transport.memory:MemoryTransport", None),
    ("transport", "directory", "dcr.adapters.transport.directory:DirectoryTransport", None),
    ("transport", "s3", "dcr.adapters.transport.s3:S3Transport", "pip install 'dcr[s3]'"),
    ("transport", "relay", "dcr.adapters.transport.relay:RelayTransport", "pip install 'dcr[zmq]'"),
):
    register(_kind, _name, _target, install=_install)
