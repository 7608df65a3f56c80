"""Adapters of a fleet process, chosen by name from the fleet file, and process plumbing.

Commit stores, control channels and transports are looked up in the adapter registry
(:mod:`dcr.adapters.registry`) by the ``kind`` the fleet file gives; the remaining keys of
each section are their options.  Every role process runs :func:`serve_until_signalled`, so
SIGTERM and SIGINT end it cleanly (its sockets closed, its children gone).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any

import anyio

from dcr.adapters.commit.base import CommitStore
from dcr.adapters.control.base import ControlChannel
from dcr.adapters.registry import load
from dcr.adapters.transport.base import Transport
from dcr.errors import ConfigError
from dcr.fleet.config import FleetConfig

__all__ = [
    "OBJECT_STORES",
    "die_with_parent",
    "make_control",
    "make_store",
    "make_transport",
    "root_node",
    "serve_until_signalled",
]


def _options(cls: type, raw: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"[{where}] has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}]: {exc}") from exc


def make_store(cfg: FleetConfig) -> CommitStore:
    """The commit store the fleet file names (``sqlite``: a file in the run directory)."""
    opts = dict(cfg.commit_store)
    kind = opts.pop("kind")
    cls = load("commit_store", kind)
    if kind == "sqlite":
        opts.pop("path", None)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        store: CommitStore = cls(cfg.store_path(), **opts)
        return store
    store = cls(**opts)
    return store


def make_control(cfg: FleetConfig, store: CommitStore) -> ControlChannel:
    """The control channel: endpoints find the coordinator through the commit record."""
    opts = dict(cfg.control)
    kind = opts.pop("kind")
    cls = load("control", kind)
    if kind != "zmq":
        raise ConfigError(f"control {kind!r} does not reach other processes; use 'zmq'")
    from dcr.adapters.control.zmq import CurveConfig, ZmqControlConfig

    curve = opts.pop("curve", None)
    opts.setdefault("bind", f"tcp://{cfg.host}:0")
    config = _options(ZmqControlConfig, opts, "control")
    if curve is not None:
        resolved = {k: str(cfg.path.parent / v) for k, v in curve.items()}
        config = ZmqControlConfig(
            **{f.name: getattr(config, f.name) for f in fields(ZmqControlConfig)
               if f.name != "curve"},
            curve=_options(CurveConfig, resolved, "control.curve"),
        )  # fmt: skip
    channel: ControlChannel = cls(store=store, config=config)
    return channel


def root_node(cfg: FleetConfig) -> str:
    """The relay node owners send to: the first rollout node (the tree's root)."""
    return cfg.rollout[0].name


OBJECT_STORES = ("directory", "s3")
"""Transport kinds that carry payloads through object storage (no relay processes)."""


def make_transport(cfg: FleetConfig, *, node: str | None = None) -> Transport:
    """The transport client of a process; ``node`` is the relay node hosting its receivers.

    ``directory``: every process opens the same directory (``path``, relative to the fleet
    file; default ``<run_dir>/objects``).  ``s3``: every process opens the same bucket and
    prefix.  The other keys are the transport's settings.  On object storage the receiver
    processes of a node share their downloads through ``<node_cache>/<node>`` (``node_cache``
    relative to the fleet file; default ``<run_dir>/fetches`` where a node hosts several
    receivers), so that each payload crosses into a node once.
    """
    opts = dict(cfg.transport)
    kind = opts.pop("kind")
    cls = load("transport", kind)
    if kind in OBJECT_STORES:
        shared = opts.pop("node_cache", None)
        hosted = next((n for n in cfg.rollout if n.name == node), None)
        if hosted is not None and (shared is not None or len(hosted.receivers) > 1):
            base = cfg.path.parent / str(shared) if shared is not None else cfg.run_dir / "fetches"
            opts["node_cache"] = str(base / hosted.name)
    if kind == "directory":
        path = opts.pop("path", None)
        root = cfg.path.parent / str(path) if path is not None else cfg.run_dir / "objects"
        directory: Transport = cls(root, **opts)
        return directory
    if kind == "s3":
        s3: Transport = cls(**opts)
        return s3
    if kind != "relay":
        raise ConfigError(
            f"transport {kind!r} is not available to a fleet; use 'relay', 'directory' or 's3'"
        )
    from dcr.adapters.transport.relay_node import RelayConfig

    opts.pop("fanout", None)
    transport: Transport = cls(
        root=cfg.address(root_node(cfg)),
        node=cfg.address(node) if node is not None else None,
        config=_options(RelayConfig, opts, "transport"),
    )
    return transport


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies, so a killed
    launcher leaves nothing running."""
    if sys.platform != "linux":
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
