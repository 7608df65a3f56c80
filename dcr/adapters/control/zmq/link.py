"""What both ends of a ZeroMQ control link share: the connection bookkeeping messages
(:class:`Hello`, :class:`Bye`, :class:`Ping`), endpoint names, the options of every control socket,
sends that never wait, and the background tasks of a link."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio

from dcr.adapters.control.zmq.config import ZmqControlConfig
from dcr.errors import ConfigError, LocalProtocolError
from dcr.protocol import messages as msg

COORDINATOR = "coordinator"
"""Sender name of frames from a coordinator link."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """Endpoint -> coordinator on connecting and every ping interval: deliver my calls.

    ``status`` is the endpoint's last reported status (``None`` before its first)."""

    status: msg.EndpointStatus | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Bye:
    """Endpoint -> coordinator: this link closes; queue later calls for the name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """Coordinator -> endpoint every ping interval: a failing send shows the endpoint gone."""


LINK_MESSAGES: tuple[type, ...] = (Hello, Bye, Ping)
"""Connection bookkeeping of this channel, encoded by the same codec as the calls."""


def routing_id(name: str) -> bytes:
    """An endpoint name as bytes, checked: 1-255 UTF-8 bytes, not starting with a zero byte.
    (Routing ids themselves are ZeroMQ's, one per connection: a peer never chooses its own.)"""
    try:
        ident = name.encode()
    except UnicodeEncodeError:
        ident = b""
    if not 0 < len(ident) <= 255 or ident[0] == 0:
        raise ConfigError(f"control endpoint name {name!r} must be 1 to 255 UTF-8 bytes")
    return ident


def set_options(sock: zmq.asyncio.Socket, config: ZmqControlConfig) -> None:
    """Options every control socket shares: no linger, bounds, reconnects, ZMTP heartbeats."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.hwm)
    sock.setsockopt(zmq.RCVHWM, config.hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(config.ping_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(config.peer_timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(config.peer_timeout_s * 1000))))


def send_now(sock: zmq.asyncio.Socket, parts: Sequence[bytes]) -> int:
    """Send without waiting; 0 when sent, else the errno (``EHOSTUNREACH``: the peer is not
    connected, ``EAGAIN``: its queue is full)."""
    future = cast(
        "asyncio.Future[object]", sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=True)
    )
    if not future.done():  # pyzmq completes a NOBLOCK send at once
        future.cancel()
        return zmq.EAGAIN
    exc = future.exception()
    if exc is None:
        return 0
    return (exc.errno or zmq.EFAULT) if isinstance(exc, zmq.ZMQError) else zmq.EFAULT


class LinkTasks:
    """Background asyncio tasks of one link; ``failure`` keeps the first unexpected error,
    and ``on_failure`` ends the link's iteration so that its reader sees the error."""

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        self.on_failure = on_failure

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self.failure is None:
            self.failure = task.exception()
        self.on_failure()

    async def cancel(self, tasks: Sequence[asyncio.Task[None]] | None = None) -> None:
        todo = list(self.tasks if tasks is None else tasks)
        for task in todo:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*todo, return_exceptions=True)

    def check(self) -> None:
        """Raise the background failure that ended the link, if any."""
        if self.failure is not None:
            raise LocalProtocolError(
                f"the control link failed: {self.failure!r}", check="link"
            ) from self.failure
