"""The control-channel interface: coordinator -> endpoint calls, endpoint -> coordinator replies.

Every message is one class of :mod:`dcr.protocol.messages`.  A coordinator process opens a
:class:`CoordinatorLink` and *calls* endpoints by name; an owner or receiver process opens an
:class:`EndpointLink` under its name, reads its calls and *notifies* coordinators with replies.
Calls and replies carry attempt ids and may be lost; the cores ignore what does not concern
them.  Two rules every channel keeps:

* a call addressed to an endpoint that is not connected (yet, or again after a restart) waits,
  bounded in number, until the endpoint connects -- so a restarted owner gets the retry's
  prepare instead of costing a prepare deadline;
* calls of a replaced coordinator are refused: each call carries its coordinator's epoch, and
  an endpoint drops (and counts) calls older than the newest epoch it has seen;
* a reply speaks for its sender only: its ``endpoint``/``receiver``/``owner`` field names the
  endpoint that sent it (else it is dropped as ``impersonation``), and replies only a
  supervisor reports (:data:`SUPERVISOR_ONLY`, ``Retired``) never come from an endpoint link
  (``supervisor-only``); a supervisor reports them to its coordinator in-process.

A reply goes to the coordinator(s) the endpoint is connected to: every open coordinator in one
process (the in-memory channel), the current one named by the commit record between processes.
A replaced coordinator learns that it was replaced from the commit store, not from replies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Self

from dcr.errors import ConfigError
from dcr.protocol import messages as msg

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = [
    "PENDING_CALLS",
    "SUPERVISOR_ONLY",
    "ControlChannel",
    "CoordinatorLink",
    "EndpointLink",
    "claimed_names",
    "refusal",
]

PENDING_CALLS = 1024
"""Calls kept per endpoint that is not connected; older ones are dropped (and counted)."""

SUPERVISOR_ONLY: tuple[type, ...] = (msg.Retired,)
"""Replies only a coordinator's own supervisor reports, never an endpoint."""
_NAME_FIELDS = ("endpoint", "receiver", "owner")


def claimed_names(reply: object) -> list[str]:
    """The endpoint names a reply speaks for (its ``endpoint``, ``receiver`` or ``owner``)."""
    names = [getattr(reply, f, None) for f in _NAME_FIELDS]
    return [n for n in names if isinstance(n, str)]


def refusal(reply: object, sender: str, role: str | None = None) -> str | None:
    """Why endpoint ``sender`` (of ``role``, when known) may not send ``reply``: the drop
    counter's name, or ``None`` when it may."""
    if isinstance(reply, SUPERVISOR_ONLY):
        return "supervisor-only"
    if any(n != sender for n in claimed_names(reply)):
        return "impersonation"
    if role is not None and isinstance(reply, msg.EndpointStatus) and reply.role != role:
        return "impersonation"
    return None


class EndpointLink(ABC):
    """An owner's or receiver's end of the channel.

    ``drops`` counts messages refused by reason (``stale-epoch``, ``decode``, ...).
    """

    name: str

    def __init__(self, name: str) -> None:
        self.name = name
        self.drops: Counter[str] = Counter()
        self.epoch = 0
        """Newest coordinator epoch seen (from calls or the commit record)."""
        self.status: msg.EndpointStatus | None = None

    @abstractmethod
    def calls(self) -> AsyncIterator[msg.Call]:
        """The calls addressed to this endpoint, in arrival order, until :meth:`aclose`."""

    @abstractmethod
    async def notify(self, reply: msg.Reply) -> None:
        """Send ``reply`` to every live coordinator."""

    async def set_status(self, status: msg.EndpointStatus) -> None:
        """Record what this endpoint holds and tell the coordinators (again on reconnect)."""
        self.status = status
        await self.notify(status)

    def admit(self, epoch: int) -> bool:
        """Whether a call of coordinator ``epoch`` may pass (older epochs are refused)."""
        if epoch < self.epoch:
            self.drops["stale-epoch"] += 1
            return False
        self.epoch = epoch
        return True

    @abstractmethod
    async def aclose(self) -> None:
        """Disconnect; calls addressed to this name wait for the next link of that name."""


class CoordinatorLink(ABC):
    """A coordinator process's end of the channel (one per process, across transitions)."""

    address: str = ""
    """Where endpoints reach this coordinator; it is written into the commit record."""

    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()

    @abstractmethod
    async def call(self, endpoint: str, message: msg.Call, *, epoch: int) -> None:
        """Deliver ``message`` from coordinator ``epoch`` to ``endpoint`` (queued while the
        endpoint is not connected)."""

    @abstractmethod
    def replies(self) -> AsyncIterator[msg.Reply]:
        """Replies from endpoints (and their supervisors), until :meth:`aclose`."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop receiving replies."""


class ControlChannel(ABC):
    """Opens the two ends of a control channel; a new channel is one subclass of this."""

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """The control channel of one process, from its fleet file section (``options``: the
        keys beside ``kind``) and the process around it (:class:`~dcr.adapters.context.
        AdapterContext`, whose ``store`` is the process's commit store: endpoints find the
        active coordinator through the commit record).  Unknown keys raise
        :class:`~dcr.errors.ConfigError`.

        Channels that a fleet file can name override it; this one refuses.
        """
        raise ConfigError(
            f"{cls.__module__}.{cls.__qualname__} defines no from_config(options, context), "
            f"so [{context.section}] cannot name it"
        )

    @abstractmethod
    async def endpoint(self, name: str) -> EndpointLink:
        """Open endpoint ``name``'s link (its inbox); calls queued for it are delivered."""

    @abstractmethod
    async def coordinator(self) -> CoordinatorLink:
        """Open a coordinator's link."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release sockets and background tasks."""
