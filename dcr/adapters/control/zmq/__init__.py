"""A ZeroMQ control channel: coordinator -> endpoint calls and replies between processes.

A coordinator link binds a ROUTER (``tcp://127.0.0.1:<random port>`` by default) whose address
the coordinator engine writes into the commit record with its epoch.  An endpoint link is a
DEALER connected to the *current* coordinator: a fixed
``address``, or the one the commit store names (``store``, read every ``watch_s``).  When the
store names a new epoch at a new address (a standby took over), the endpoint says goodbye to
the old coordinator, connects to the new one and says hello there; from then on it refuses
calls of older epochs (:meth:`~dcr.adapters.control.base.EndpointLink.admit`).

Connection bookkeeping, kept small and explicit:

* an endpoint sends :class:`Hello` (with its last :class:`~dcr.protocol.messages.EndpointStatus`)
  when it connects and then every ``ping_s`` as its heartbeat, and :class:`Bye` when it closes;
* the coordinator delivers calls only to endpoints that said hello; calls to any other name
  wait in a queue of at most ``pending_calls`` per endpoint (the oldest is dropped and counted)
  and leave, in order, with the endpoint's next hello;
* the coordinator sends :class:`Ping` to each connected endpoint every ``ping_s``.  With
  ``ROUTER_MANDATORY`` a send to a peer whose TCP connection is gone fails at once, so a
  SIGKILLed endpoint is noticed within one interval; an endpoint silent for ``peer_timeout_s``
  counts as gone too (not counting time the coordinator's own process did not run: a starved
  or paused coordinator does not take its own deafness for its peers' silence).  ZeroMQ's own
  heartbeats drop connections to hosts that vanished without
  closing them.

Who speaks.  With the fleet's keys (:class:`~dcr.adapters.security.Security`) every
connection is CURVE, encrypted and authenticated: the coordinator admits only keyring members
with an owner or receiver key, and a frame counts as sent by the name its key belongs to
(ZeroMQ's ``User-Id``): a sender name that differs is dropped.  Routing ids are then ZeroMQ's,
one per connection (no ``ROUTER_HANDOVER``): no peer chooses its own, so no connection can take
over another's calls; a name's calls go to its newest authenticated connection (a restarted
endpoint takes over its own name, nobody else's).  Without keys (loopback fleets) an endpoint's
routing id is its name, ``ROUTER_HANDOVER`` lets a restarted endpoint take it over, and a
frame's sender must equal its routing id.  Either way a reply must speak for its sender only (its
``endpoint``/``receiver``/``owner`` field equals the sender, an ``EndpointStatus``'s role is the
key's), and :class:`~dcr.protocol.messages.Retired`, which only a coordinator's own
supervisor reports, is refused from every connection.

Replies go to the one coordinator the endpoint is connected to (the one its configuration or
the commit store names).  A call sent in the instant its endpoint dies can be lost; the cores
tolerate lost messages.  Every received frame goes through
:class:`~dcr.adapters.control.codec.ControlCodec`;
a frame that fails to decode, has the wrong number of
parts, arrives in the wrong direction (a call at a coordinator, a reply at an endpoint) or, at
a coordinator, names a sender other than its connection's routing id is dropped, changes
nothing, and is counted in the receiving link's ``drops``:

* both ends: the codec's ``check`` (``oversized``, ``truncated``, ``malformed``, ``version``,
  ``type``, ``schema``), ``parts``, ``direction``, ``closed`` (used after ``aclose``);
* coordinator: ``sender`` (not the key's name, or not a valid name), ``impersonation`` (a
  reply speaking for another endpoint or role), ``supervisor-only``, ``pending-overflow`` (a
  waiting call dropped for a newer one), ``overflow`` (a reply dropped because
  ``replies_buffer`` replies were not read), ``peer-overflow`` (one endpoint already has
  ``replies_per_endpoint`` replies unread);
* endpoint: ``stale-epoch``, ``unsent`` (the send queue was full), ``no-coordinator`` (no
  address known yet), ``address`` (the store named an address that cannot be connected to),
  ``store`` (a failed store read).

A key not in the keyring never completes its connection (counted in ``ZmqControl.auth``).
A coordinator refuses to bind a non-loopback address without keys unless the fleet says
``insecure = true``.  pyzmq's asyncio sockets need the asyncio backend of anyio.
"""

from dcr.adapters.control.zmq.channel import ZmqControl
from dcr.adapters.control.zmq.config import ZmqControlConfig
from dcr.adapters.control.zmq.coordinator import ZmqCoordinatorLink
from dcr.adapters.control.zmq.endpoint import ZmqEndpointLink
from dcr.adapters.control.zmq.link import COORDINATOR, LINK_MESSAGES, Bye, Hello, Ping

__all__ = [
    "COORDINATOR",
    "LINK_MESSAGES",
    "Bye",
    "Hello",
    "Ping",
    "ZmqControl",
    "ZmqControlConfig",
    "ZmqCoordinatorLink",
    "ZmqEndpointLink",
]
