"""What travels in the protocol world (:mod:`dcr.testing.protocol_world`): messages in flight
-- payloads, control calls and replies, control-plane requests and answers, completions of
local engine work -- and the abstract payload content they carry.

A message is delivered only when the world is asked to, in any order, twice, or not at all;
:attr:`Message.droppable` says which ones the engine contract allows to be lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dcr.protocol import messages as msg
from dcr.protocol.types import PayloadKey
from dcr.testing.spec.state import Encoding

__all__ = ["ApplyDone", "Body", "Kind", "Message", "Wire"]


class Kind(enum.Enum):
    PAYLOAD = "payload"
    CALL = "call"
    """Coordinator -> endpoint control call."""
    REPLY = "reply"
    """Endpoint -> coordinator (a Notify)."""
    STORE = "store"
    """Coordinator -> control plane request."""
    STORE_REPLY = "store_reply"
    LOCAL = "local"
    """Completion of local engine work (decode, apply, build, send, gate, sync)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Body:
    """Abstract payload content: which range it writes, how, and a digest of its bytes."""

    key: PayloadKey
    encoding: Encoding
    final: bool
    digest: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    seq: int
    kind: Kind
    to: str
    """``store``, ``c<epoch>``, or an endpoint name."""
    event: object
    epoch: int = 0
    """Sender epoch of a control-plane request."""
    inc: int = 0
    """Incarnation of the receiver the message was sent to."""
    body: Body | None = None

    @property
    def droppable(self) -> bool:
        if self.kind is Kind.PAYLOAD:
            return True
        if self.kind is Kind.CALL:
            return not isinstance(self.event, msg.Cleanup | msg.ReopenGate | msg.ReadRecord)
        if self.kind is Kind.REPLY:
            return not isinstance(self.event, msg.BaselineUpdated | msg.ReceiverReady)
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Wire:
    """A payload on its way: the key the transport names and what its bytes would show."""

    key: PayloadKey
    digest: bytes
    final: bool
    rejection: str | None = None


@dataclass(frozen=True, slots=True)
class ApplyDone:
    """Writes of an Apply land when the engine completes it."""

    keys: tuple[PayloadKey, ...]
    fail_after: int | None = None
