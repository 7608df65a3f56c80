"""The root's admission of owners' payloads, the relay tree's flow control at its entry (paper
§7.1, App. B "Transports"): owners offer payloads, offers wait in arrival order until the root's
buffer has room, the root grants room, and the owner's data follows (through the emulated
cross-cluster link when one is set); the root counts V_cross and V_payload as it takes data.
Stop, cleanup and status queries from owners and the coordinator arrive here too.

Every offer counts against its peer's bounds (``RelayConfig``, "Per peer"): a peer's offers
waiting or granted, the room granted to it (an offer of a peer at its bound waits without
holding up other peers' offers, so one owner cannot take the whole buffer), and data it sends
without a grant, which is refused before it is queued anywhere.
"""

from __future__ import annotations

import time
from collections import deque

import anyio

from dcr.adapters.transport.base import TransportStats
from dcr.adapters.transport.relay.forwarding import Forwarding
from dcr.adapters.transport.relay.frames import (
    Answer,
    Cancel,
    Data,
    Frame,
    Grant,
    Offer,
    Ping,
    Pong,
    Query,
    Sized,
    Stop,
)
from dcr.adapters.transport.relay.state import Arrival, Client, Granted, Transfer

__all__ = ["Grants"]


class Grants(Forwarding):
    """Requests of owners and the coordinator (offers, data, stops, queries), served at the
    root (the layer below :class:`~dcr.adapters.transport.relay.guard.Guard`)."""

    # -- owners and the coordinator (root) --------------------------------------------------

    def _on_client(
        self, client: Client, frame: Frame, body: Sized | None, header: int, now: float
    ) -> None:
        """One frame of a client; ``header`` is the length of its header frame."""
        ident = client.ident
        client.heard = now
        if isinstance(frame, Ping):
            self._reply(ident, Pong(nonce=self.nonce))
            return
        if isinstance(frame, Data):
            assert body is not None
            self._on_data(client, frame, body, now)
            return
        if isinstance(frame, Cancel):
            granted = self._take_grant(ident, frame.seq)
            if granted is not None:
                self._release(1, granted.offer.size)
                return
            before = len(self._offers)
            self._offers = deque(
                (i, o) for i, o in self._offers if (i, o.seq) != (ident, frame.seq)
            )
            if len(self._offers) == before:
                self.drops["unknown"] += 1
            else:
                self._offer_gone(ident)
            return
        assert isinstance(frame, Offer | Stop | Query)
        if frame.seq <= client.last_seq:
            self.drops["replayed"] += 1
            return
        client.last_seq = frame.seq
        if isinstance(frame, Query):
            self._reply(
                ident,
                Answer(
                    seq=frame.seq,
                    receivers=self.receivers(),
                    payloads=self._stats.payloads,
                    payload_bytes=self._stats.payload_bytes,
                    cross_bytes=self._stats.cross_bytes,
                ),
            )
        elif not self.is_root:
            self._refuse(ident, frame.seq, "not-root", f"{self.name} is not the root", False)
        elif isinstance(frame, Stop):
            wave = next(self._seq)
            self._start_wave(frame.attempt, frame.cleanup, self.nonce, wave, (ident, frame.seq))
        else:
            self._on_offer(client, frame, header)

    def _on_offer(self, client: Client, offer: Offer, header: int) -> None:
        ident, config = client.ident, self.config
        if offer.key.attempt in self._stopped:
            self._refuse(ident, offer.seq, "stopped", "the attempt was stopped", False)
        elif offer.size > config.max_payload_bytes:
            limit = config.max_payload_bytes
            self.drops["oversized"] += 1
            self._refuse(
                ident, offer.seq, "oversized",
                f"payload of {offer.size} bytes above this relay's limit of {limit} bytes "
                "(max_payload_bytes: from the fleet's catalog and bucket size unless set)",
                False,
            )  # fmt: skip
        elif header > config.max_offer_header_bytes:
            self.drops["oversized"] += 1
            self._refuse(
                ident, offer.seq, "oversized",
                f"an offer's recipient list above {config.max_offer_header_bytes} bytes "
                "(max_offer_header_bytes)",
                False,
            )  # fmt: skip
        elif client.budget.offers >= config.max_peer_offers:
            client.budget.over = "offers"  # the peer is refused as a whole (Guard)
        elif len(self._offers) >= config.max_waiting_offers:
            self._refuse(
                ident, offer.seq, "busy",
                f"{len(self._offers)} offers wait at the root already (max_waiting_offers)",
                True,
            )  # fmt: skip
        else:
            self._offers.append((ident, offer))
            client.offers += 1
            client.budget.offers += 1
            self._admit_due = True

    def _admit(self) -> None:
        """Grant room to waiting offers in arrival order while the buffer has room; an offer of
        a peer at its room bound (``max_peer_granted_bytes``) waits, and so do that peer's
        later offers (its payloads keep their order), without holding up other peers'.

        An offer addressed by name to receivers none of which is subscribed in the tree waits
        the same way, up to ``peer_timeout_s``, for one of them to subscribe: a dense refit is
        sent to a receiver that has just started, whose subscription may still be on its way
        up the tree, and delivering the payload to nobody would lose it.  After that it goes
        through and reaches nobody (a receiver that is gone)."""
        if not self._admit_due:
            return
        self._admit_due = False
        config, now = self.config, time.monotonic()
        waiting: deque[tuple[bytes, Offer]] = deque()
        blocked: set[str] = set()
        full = False
        known: frozenset[str] | None = None  # the tree's receivers, looked up when needed
        unheard: dict[tuple[bytes, int], float] = {}
        for ident, offer in self._offers:
            client = self._clients.get(ident)
            if client is None:
                continue
            budget = client.budget
            if full or budget.key in blocked:
                waiting.append((ident, offer))
                continue
            if offer.to and known is None:
                known = self.receivers()
            if offer.to and known is not None and not offer.to & known:
                since = self._unheard.get((ident, offer.seq), now)
                if now - since < config.peer_timeout_s:
                    unheard[(ident, offer.seq)] = since
                    blocked.add(budget.key)
                    waiting.append((ident, offer))
                    continue
            held = budget.granted_bytes
            if held and held + offer.size > config.max_peer_granted_bytes:
                blocked.add(budget.key)
                waiting.append((ident, offer))
                continue
            if not self._fits(offer.size):
                full = True
                waiting.append((ident, offer))
                continue
            self._granted[(ident, offer.seq)] = Granted(offer=offer, at=now)
            client.granted.add(offer.seq)
            budget.granted_bytes += offer.size
            self._hold(1, offer.size)
            self._reply(ident, Grant(seq=offer.seq))  # may forget the client
        self._offers = deque((i, o) for i, o in waiting if i in self._clients)
        self._unheard = unheard
        if unheard:
            self._admit_due = True  # at the next tick, or when a receiver subscribes

    def _on_data(self, client: Client, frame: Data, body: Sized, now: float) -> None:
        """Data of a granted offer: checked against its grant before anything is queued."""
        granted = self._take_grant(client.ident, frame.seq)
        if granted is None:
            # Room this root never granted, or released meanwhile (a stop, a grant that timed
            # out, a client silent for peer_timeout_s): the sender, if it still waits,
            # retries in a new attempt.  Nothing of it is kept.
            self.drops["unknown"] += 1
            client.budget.ungranted += frame.size
            self._refuse(client.ident, frame.seq, "lost", "no room was granted for it", True)
            return
        client.budget.progress = now
        offer = granted.offer
        if offer.size != frame.size:
            self._release(1, offer.size)
            self.drops["malformed"] += 1
            self._refuse(client.ident, frame.seq, "size", "data size differs from offer", False)
            return
        if self.ingress.bytes_per_s is not None:
            # Its room stays the peer's until the root's link carried it.
            client.budget.granted_bytes += offer.size
            self._arrivals.append(Arrival(client=client, frame=frame, body=body, offer=offer))
            self._arrived.set()
            return
        self._take_data(client.ident, frame, body, offer)

    def _take_data(self, ident: bytes, frame: Data, body: Sized, offer: Offer) -> None:
        """The root takes a granted payload (its room is already held): count it, route it."""
        s = self._stats
        self._stats = TransportStats(
            payloads=s.payloads,
            payload_bytes=s.payload_bytes,
            cross_bytes=s.cross_bytes + frame.size,
        )
        counts = self._by_attempt.setdefault(offer.key.attempt, [0, 0])
        counts[0] += frame.size
        while len(self._by_attempt) > 1024:
            del self._by_attempt[next(iter(self._by_attempt))]
        if offer.key not in self._seen:
            self._seen[offer.key] = frame.size
            counts[1] += frame.size
            s = self._stats
            self._stats = TransportStats(
                payloads=s.payloads + 1,
                payload_bytes=s.payload_bytes + frame.size,
                cross_bytes=s.cross_bytes,
            )
        t = Transfer(
            seq=next(self._seq),
            origin=self.nonce,
            key=offer.key,
            to=offer.to,
            body=body,
            size=frame.size,
            client=(ident, frame.seq),
        )
        self._route(t)

    def _forget_client(self, ident: bytes) -> None:
        """The client vanished: release room granted to it and drop its waiting offers and
        its data waiting for the root's link."""
        client = self._clients.pop(ident, None)
        if client is None:
            return
        budget = client.budget
        for seq in client.granted:
            granted = self._granted.pop((ident, seq), None)
            if granted is not None:
                budget.granted_bytes -= granted.offer.size
                self._release(1, granted.offer.size)
        client.granted.clear()
        budget.offers -= client.offers
        budget.users -= 1
        client.offers = 0
        self._offers = deque((i, o) for i, o in self._offers if i != ident)
        for arrival in self._arrivals:
            if arrival.client is client and not arrival.dropped:
                self._drop_arrival(arrival)
        self._admit_due = True

    async def _ingress_forever(self) -> None:
        """Take payload bytes from owners through the emulated link, one transfer after the
        other in arrival order; control frames do not wait behind them."""
        while True:
            while not self._arrivals:
                self._arrived = anyio.Event()
                await self._arrived.wait()
            arrival = self._arrivals[0]
            if not arrival.dropped:
                await self.ingress.pace(arrival.frame.size)
            self._arrivals.popleft()
            if arrival.dropped:
                continue
            arrival.client.budget.granted_bytes -= arrival.offer.size
            self._admit_due = True
            self._take_data(arrival.client.ident, arrival.frame, arrival.body, arrival.offer)
            self._admit()
