"""An in-memory control channel: inboxes are anyio memory streams in one process."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dcr.adapters.control.base import ControlChannel
from dcr.errors import ConfigError
from dcr.protocol.events import CoordinatorEvent

__all__ = ["MemoryControl"]

_Pair = tuple[MemoryObjectSendStream[Any], MemoryObjectReceiveStream[Any]]


class MemoryControl(ControlChannel):
    """Every message is delivered at once into the addressee's unbounded inbox."""

    def __init__(self) -> None:
        self._endpoints: dict[str, _Pair] = {}
        self._coordinators: dict[int, _Pair] = {}

    @staticmethod
    def _put(pair: _Pair | None, message: object) -> None:
        if pair is None:
            return
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            pair[0].send_nowait(message)

    async def call(self, endpoint: str, message: object) -> None:
        self._put(self._endpoints.get(endpoint), message)

    async def notify(self, event: CoordinatorEvent) -> None:
        for pair in list(self._coordinators.values()):
            self._put(pair, event)

    async def post(self, epoch: int, event: CoordinatorEvent) -> None:
        self._put(self._coordinators.get(epoch), event)

    def endpoint_inbox(self, name: str) -> AsyncIterator[object]:
        return self._open(self._endpoints, name)

    def close_endpoint(self, name: str) -> None:
        self._close(self._endpoints, name)

    def coordinator_inbox(self, epoch: int) -> AsyncIterator[CoordinatorEvent]:
        return self._open(self._coordinators, epoch)

    def close_coordinator(self, epoch: int) -> None:
        self._close(self._coordinators, epoch)

    @staticmethod
    def _open(table: dict[Any, _Pair], key: object) -> AsyncIterator[Any]:
        if key in table:
            raise ConfigError(f"an inbox named {key!r} is already open")
        send, recv = anyio.create_memory_object_stream[Any](math.inf)
        table[key] = (send, recv)
        return recv.__aiter__()

    @staticmethod
    def _close(table: dict[Any, _Pair], key: object) -> None:
        pair = table.pop(key, None)
        if pair is not None:
            pair[0].close()
            pair[1].close()
