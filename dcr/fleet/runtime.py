"""Adapters of a fleet process, chosen by name from the fleet file, and process plumbing.

Commit stores, control channels and transports are looked up in the adapter registry
(:mod:`dcr.adapters.registry`: dcr's own adapters, entry points of other distributions, or a
``"package.module:Class"`` given directly) by the ``kind`` the fleet file gives.  Each class
builds itself with ``from_config(options, context)`` from the remaining keys of its section
and an :class:`~dcr.adapters.context.AdapterContext` made here from the fleet file, so this
module knows no kind by name: defaults, relative paths and per-node settings belong to the
adapters.  Every role process runs :func:`serve_until_signalled`, so SIGTERM and SIGINT end
it cleanly (its sockets closed, its children gone).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.context import AdapterContext, dataclass_options
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.registry import load
from dcr.adapters.security import Identity
from dcr.adapters.transport.base import Transport
from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig

__all__ = [
    "LAUNCHED",
    "adapter_context",
    "die_with_parent",
    "make_control",
    "make_store",
    "make_transport",
    "relayed",
    "root_node",
    "serve_until_signalled",
    "transport_class",
]


def _options(cls: type, raw: dict[str, Any], where: str) -> Any:
    """An instance of the dataclass ``cls`` from section ``where`` of the fleet file."""
    return dataclass_options(cls, raw, where)


def adapter_context(
    cfg: FleetConfig,
    section: str,
    *,
    node: str | None = None,
    store: CommitStore | None = None,
    identity: Identity | None = None,
) -> AdapterContext:
    """What an adapter built from section ``section`` of ``cfg`` learns about its process:
    ``node`` is the rollout node hosting the process's receivers, ``store`` its commit store,
    ``identity`` who the process is on the fleet's sockets."""
    hosted = next((n for n in cfg.rollout if n.name == node), None)
    return AdapterContext(
        section=section,
        base_dir=cfg.path.parent,
        run_dir=cfg.run_dir,
        host=cfg.host,
        fleet=cfg.name,
        node=node,
        node_receivers=len(hosted.receivers) if hosted is not None else 0,
        nodes=tuple(n.name for n in cfg.rollout),
        address=cfg.address,
        store=store,
        security=cfg.security(),
        identity=identity,
    )


def _section(raw: Mapping[str, Any], section: str) -> tuple[str, dict[str, Any]]:
    """The ``kind`` of a section and its other keys (the adapter's options)."""
    opts = dict(raw)
    kind = opts.pop("kind", None)
    if not isinstance(kind, str) or not kind:
        raise ConfigError(
            f"[{section}] kind must be a registered name or 'package.module:Class', got {kind!r}"
        )
    return kind, opts


def _adapter_class(section: str, kind: str, base: type) -> type:
    """The class ``kind`` names as the adapter of ``section``: a subclass of ``base``."""
    cls = load(section, kind)
    if not issubclass(cls, base):
        raise ConfigError(
            f"{section}.kind {kind!r} names {cls.__module__}.{cls.__qualname__}, which is not "
            f"a {base.__module__}.{base.__qualname__}"
        )
    return cls


def transport_class(cfg: FleetConfig) -> type[Transport]:
    """The transport class the fleet file names (imported, not built)."""
    kind, _ = _section(cfg.transport, "transport")
    cls: type[Transport] = _adapter_class("transport", kind, Transport)
    return cls


def relayed(cfg: FleetConfig) -> bool:
    """Whether the fleet's payloads travel through relay processes (``dcr relay``, one per
    rollout node) that the launcher starts."""
    return transport_class(cfg).needs_relay_processes


def make_store(cfg: FleetConfig) -> CommitStore:
    """The commit store the fleet file names (``[commit_store]``), built by its class's
    ``from_config`` (the default, SQLite: ``<run_dir>/commit.db``)."""
    kind, opts = _section(cfg.commit_store, "commit_store")
    cls: type[CommitStore] = _adapter_class("commit_store", kind, CommitStore)
    return cls.from_config(opts, adapter_context(cfg, "commit_store"))


def make_control(cfg: FleetConfig, store: CommitStore) -> ControlChannel:
    """The control channel (``[control]``): endpoints find the coordinator through the
    commit record of ``store``."""
    kind, opts = _section(cfg.control, "control")
    cls: type[ControlChannel] = _adapter_class("control", kind, ControlChannel)
    return cls.from_config(opts, adapter_context(cfg, "control", store=store))


def root_node(cfg: FleetConfig) -> str:
    """The relay node owners send to: the first rollout node (the tree's root)."""
    return cfg.rollout[0].name


def make_transport(
    cfg: FleetConfig, *, node: str | None = None, identity: Identity | None = None
) -> Transport:
    """The transport client of a process (``[transport]``); ``node`` is the rollout node
    hosting its receivers, ``identity`` who the process is (``owner:o0``, ``receiver:r0``,
    ``coordinator:main``; with keys, its relay sockets use that identity's key).

    The transport's class builds it from the section's keys and the process's context: the
    relay tree connects to the root (and to ``node``); an object store opens the storage
    every process shares (a directory's ``path`` relative to the fleet file, default
    ``<run_dir>/objects``), and the receiver processes of a node share their downloads
    through ``<node_cache>/<node>`` (default ``<run_dir>/fetches/<node>`` where a node hosts
    several receivers).
    """
    _, opts = _section(cfg.transport, "transport")
    context = adapter_context(cfg, "transport", node=node, identity=identity)
    return transport_class(cfg).from_config(opts, context)


LAUNCHED = "DCR_LAUNCHED"
"""Set (to ``1``) in the environment of every process a dcr launcher starts."""


def die_with_parent() -> None:
    """Linux: a process a dcr launcher started (``DCR_LAUNCHED=1``) gets SIGKILL when the
    launcher dies, so a killed launcher leaves nothing running.  A role started by hand (from
    a shell, a service manager) outlives its parent."""
    if sys.platform != "linux" or os.environ.get(LAUNCHED) != "1":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


async def serve_until_signalled(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` until it returns or SIGTERM/SIGINT arrives; then cancel it cleanly."""
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

        async def run() -> None:
            await main()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
