"""A ZeroMQ control channel: coordinator -> endpoint calls and replies between processes.

A coordinator link binds a ROUTER (``tcp://127.0.0.1:<random port>`` by default) whose address
the coordinator engine writes into the commit record with its epoch.  An endpoint link is a
DEALER whose routing id is the endpoint's name, connected to the *current* coordinator: a fixed
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
  counts as gone too.  ``ROUTER_HANDOVER`` lets a restarted endpoint take over its name.
  ZeroMQ's own heartbeats drop connections to hosts that vanished without closing them.

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
* coordinator: ``sender``, ``pending-overflow`` (a waiting call dropped for a newer one),
  ``overflow`` (a reply dropped because ``replies_buffer`` replies were not read);
* endpoint: ``stale-epoch``, ``unsent`` (the send queue was full), ``no-coordinator`` (no
  address known yet), ``address`` (the store named an address that cannot be connected to),
  ``store`` (a failed store read).

Optional CURVE encryption and authentication (:class:`CurveConfig`, key files made with
``zmq.auth.create_certificates``) is checked by an in-process ZAP handler: an endpoint whose
public key is not in ``authorized_clients_dir`` never completes its connection.  pyzmq's
asyncio sockets need the asyncio backend of anyio.
"""

from dcr.adapters.control.zmq.channel import ZmqControl
from dcr.adapters.control.zmq.config import CurveConfig, ZmqControlConfig
from dcr.adapters.control.zmq.coordinator import ZmqCoordinatorLink
from dcr.adapters.control.zmq.endpoint import ZmqEndpointLink
from dcr.adapters.control.zmq.link import COORDINATOR, LINK_MESSAGES, Bye, Hello, Ping

__all__ = [
    "COORDINATOR",
    "LINK_MESSAGES",
    "Bye",
    "CurveConfig",
    "Hello",
    "Ping",
    "ZmqControl",
    "ZmqControlConfig",
    "ZmqCoordinatorLink",
    "ZmqEndpointLink",
]
