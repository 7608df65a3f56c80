"""The fleet's roles as Ray actors: relay nodes, coordinators, receivers, vLLM engines whose
workers are receivers, trainer ranks, and the directory that names where relay nodes and
engines listen.

Each actor runs its role exactly as the process fleet does (:func:`~dcr.fleet.relay.
serve_relay`, :func:`~dcr.fleet.coordinator.run_coordinator`), on an event loop of its own in
a thread that its constructor starts: when Ray restarts an actor (``max_restarts``) it runs
the constructor again, so the role is back without anyone calling it.  A restarted relay node
binds the address it had (the directory remembers it), so its children and receivers
reconnect by themselves; a restarted coordinator takes over as in the process fleet.

These classes are plain Python; :mod:`dcr.ray.fleet` makes them actors with ``ray.remote``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import anyio

from dcr.fleet.config import FleetConfig

__all__ = [
    "BIND_WAIT_S",
    "ENGINE_WAIT_S",
    "CoordinatorActor",
    "Directory",
    "EngineActor",
    "ReceiverActor",
    "RelayActor",
    "TrainerActor",
]

BIND_WAIT_S = 60.0
"""How long :meth:`RelayActor.address` waits for the node to bind."""

ENGINE_WAIT_S = 900.0
"""How long :meth:`EngineActor.url` waits for the engine to serve."""

_LINGER_S = 5.0
"""How long an actor whose role failed stays up before it exits (and Ray restarts it): long
enough for a call already waiting on the role to learn why on a loaded machine."""

_REGISTER_S = 2.0
"""How often a relay node tells the directory its address again (a restarted directory)."""


class Directory:
    """Where the fleet's relay nodes listen, by node name (Ray's naming of the fleet): the
    driver, relay nodes and receivers ask it instead of reading files on a shared disk.  A
    restarted directory is filled again by the relay nodes within a couple of seconds."""

    def __init__(self) -> None:
        self._relays: dict[str, str] = {}
        self._engines: dict[str, str] = {}
        self._config: FleetConfig | None = None

    def set_config(self, cfg: FleetConfig) -> None:
        self._config = cfg

    def config(self) -> FleetConfig | None:
        """The fleet config every role uses, relay addresses included (``None`` until the
        fleet's driver started it)."""
        if self._config is None:
            return None
        return replace(self._config, relay_addresses={**self._config.relay_addresses,
                                                      **self._relays})  # fmt: skip

    def set_relay(self, node: str, address: str) -> None:
        self._relays[node] = address

    def relay(self, node: str) -> str | None:
        return self._relays.get(node)

    def relays(self) -> dict[str, str]:
        return dict(self._relays)

    def set_engine(self, name: str, url: str) -> None:
        self._engines[name] = url

    def engine(self, name: str) -> str | None:
        """The URL engine ``name`` serves on (``None`` until it serves)."""
        return self._engines.get(name)


class _Role:
    """Runs ``main`` on an event loop of its own in a daemon thread.  A role that fails ends
    its actor's process (its error on stderr, in the actor's log), so that Ray restarts the
    actor within its ``max_restarts`` budget and then reports it dead."""

    def __init__(self, main: Callable[[], Awaitable[None]], name: str) -> None:
        self.failure: str | None = None
        self.name = name
        self._thread = threading.Thread(target=self._run, args=(main,), name=name, daemon=True)
        self._thread.start()

    def _run(self, main: Callable[[], Awaitable[None]]) -> None:
        try:
            anyio.run(main)
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the error itself, not the task group around it
            self.failure = f"{type(exc).__name__}: {exc}"
            print(f"dcr: {self.name} failed: {self.failure}", file=sys.stderr, flush=True)
            time.sleep(_LINGER_S)  # a caller waiting on the role learns why
            os._exit(1)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> str | None:
        """Wait until the role ends; how it failed (``None``: it returned)."""
        self._thread.join()
        return self.failure


class RelayActor:
    """Relay node ``node`` of the fleet, bound to ``ip`` (the Ray node's address); its parent's
    address and its own earlier one come from the directory ``directory``."""

    def __init__(self, cfg: FleetConfig, node: str, ip: str, directory: Any) -> None:
        self.node = node
        self._directory = directory
        self._bound = threading.Event()
        self._address = ""
        import ray

        relays: dict[str, str] = ray.get(directory.relays.remote())
        port = next((n.port for n in cfg.rollout if n.name == node), 0)
        bind = relays.get(node) or f"tcp://{ip}:{port}"
        self._cfg = replace(cfg, relay_addresses={**cfg.relay_addresses, **relays})
        self._role = _Role(self._main(bind), f"dcr-relay-{node}")

    def _main(self, bind: str) -> Callable[[], Awaitable[None]]:
        from dcr.fleet.relay import serve_relay

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._register)
                await serve_relay(self._cfg, self.node, bind=bind, on_bound=self._on_bound)

        return main

    def _on_bound(self, address: str) -> None:
        self._address = address
        self._bound.set()

    async def _register(self) -> None:
        import ray

        while not self._bound.is_set():  # polled: a failed bind cancels this at once
            await anyio.sleep(0.05)
        while True:
            ref = self._directory.set_relay.remote(self.node, self._address)
            with contextlib.suppress(Exception):  # a directory being restarted
                await anyio.to_thread.run_sync(ray.get, ref)
            await anyio.sleep(_REGISTER_S)

    def address(self) -> str:
        """The address this node listens on, once bound (a ``RuntimeError`` if it failed)."""
        deadline = time.monotonic() + BIND_WAIT_S
        while not self._bound.wait(0.1):
            failed = self._role.failure is not None or not self._role.alive()
            if failed or time.monotonic() > deadline:
                raise RuntimeError(
                    f"relay node {self.node} did not bind: {self._role.failure or 'timed out'}"
                )
        return self._address

    def alive(self) -> bool:
        return self._role.alive()

    def pid(self) -> int:
        return os.getpid()


class CoordinatorActor:
    """Coordinator ``name`` of the fleet (the active one or a standby: the lease decides)."""

    def __init__(self, cfg: FleetConfig, name: str) -> None:
        from dcr.fleet.coordinator import run_coordinator

        self.name = name
        self._serving: tuple[Any, asyncio.AbstractEventLoop] | None = None
        self._lost: list[str] = []  # reported before the coordinator was made
        self._lock = threading.Lock()

        def started(coordinator: Any) -> None:
            with self._lock:
                coordinator.depart(self._lost)
                self._serving = (coordinator, asyncio.get_running_loop())

        async def main() -> None:
            await run_coordinator(cfg, name, started=started)

        self._role = _Role(main, f"dcr-{name}")

    def alive(self) -> bool:
        return self._role.alive()

    def depart(self, receivers: list[str]) -> None:
        """Report ``receivers`` lost for good (their Ray node died): the active coordinator
        lets them depart at once instead of after ``[coordinator] depart_after_s``; a standby
        keeps the report for when it becomes active (and takes over an attempt that binds
        them, say).  Kept also when this coordinator is still starting."""
        with self._lock:
            if self._serving is None:
                self._lost.extend(receivers)
                return
            coordinator, loop = self._serving
        loop.call_soon_threadsafe(coordinator.depart, list(receivers))


class ReceiverActor:
    """Receiver ``name`` of the fleet, served as ``dcr receiver`` serves it (its rank of the
    fleet's model, restored by dense refit when it starts)."""

    def __init__(self, cfg: FleetConfig, name: str) -> None:
        from dcr.fleet.receiver import run_receiver

        async def main() -> None:
            await run_receiver(cfg, name)

        self._role = _Role(main, f"dcr-{name}")

    def alive(self) -> bool:
        return self._role.alive()

    def pid(self) -> int:
        return os.getpid()


class EngineActor:
    """The vLLM engine ``[[engine]] name`` of the fleet, served as ``python -m
    dcr.integrations.vllm`` serves it (an ``AsyncLLM`` whose workers join the fleet as the
    engine's receivers, token-in/token-out HTTP on this node), its URL registered in the
    directory.  Restarted by Ray, it starts a fresh engine whose workers restore the committed
    version by dense refit, and registers its new URL."""

    def __init__(self, cfg: FleetConfig, name: str, directory: Any, host: str = "127.0.0.1"):
        from dcr.integrations.vllm.gate import PauseMode
        from dcr.integrations.vllm.server import ServerOptions, serve

        self.name = name
        engine = next(e for e in cfg.engines if e.name == name)
        self._directory = directory
        self._url = ""
        options = ServerOptions(
            model=str(engine.model or cfg.model.checkpoint),
            tensor_parallel_size=len(engine.receivers),
            dtype=engine.dtype,
            max_model_len=engine.max_model_len,
            plain_weights=engine.plain_weights,
            fleet=cfg,
            receivers=engine.receivers,
            checkpoint_version=engine.checkpoint_version,
            report_fingerprints=cfg.trainer.synthetic,  # what the run checks them against
            pause_mode=cast("PauseMode | None", engine.pause_mode),  # the section checked it
            prefix_caching=engine.prefix_caching,
            chunked_prefill=engine.chunked_prefill,
            host=host,
            on_serving=self._on_serving,
        )

        async def main() -> None:
            await serve(options)

        self._role = _Role(main, f"dcr-engine-{name}")

    def _on_serving(self, url: str) -> None:
        import ray

        self._url = url
        ray.get(self._directory.set_engine.remote(self.name, url))

    def url(self) -> str:
        """The engine's URL once it serves (waits; a ``RuntimeError`` if it failed)."""
        deadline = time.monotonic() + ENGINE_WAIT_S
        while not self._url:
            if self._role.failure is not None or not self._role.alive():
                raise RuntimeError(f"engine {self.name} failed: {self._role.failure}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.name} did not serve in {ENGINE_WAIT_S:.0f} s")
            time.sleep(0.1)
        return self._url

    def alive(self) -> bool:
        return self._role.alive()

    def pid(self) -> int:
        return os.getpid()


class TrainerActor:
    """Trainer rank ``rank`` of the fleet's ``[trainer] kind`` (its owner joins the fleet
    through the trainer-side join), meeting the other ranks at ``store`` (``host:port`` of the
    rendezvous store)."""

    def __init__(self, cfg: FleetConfig, rank: int, store_port: int) -> None:
        from dcr.fleet.trainer import run_trainer

        async def main() -> None:
            await run_trainer(cfg, rank, store_port)

        self._role = _Role(main, f"dcr-rank-{rank}")

    def alive(self) -> bool:
        return self._role.alive()

    def join(self) -> str | None:
        """Wait until the rank ends (the trainer's last step); how it failed, if it did."""
        return self._role.join()
