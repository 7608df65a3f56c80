"""The root's admission of owners' payloads, the relay tree's flow control at its entry (paper
§7.1, App. B "Transports"): owners offer payloads, offers wait in arrival order until the root's
buffer has room, the root grants room, and the owner's data follows (through the emulated
cross-cluster link when one is set); the root counts V_cross and V_payload as data arrives.
Stop, cleanup and status queries from owners and the coordinator arrive here too.
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
from dcr.adapters.transport.relay.state import Client, Transfer

__all__ = ["Grants"]


class Grants(Forwarding):
    """Requests of owners and the coordinator (offers, data, stops, queries), served at the
    root (the layer below :class:`~dcr.adapters.transport.relay.node.RelayNode`)."""

    # -- owners and the coordinator (root) --------------------------------------------------

    def _on_client(self, ident: bytes, frame: Frame, body: Sized | None, now: float) -> None:
        client = self._clients.get(ident)
        if client is None:
            client = self._clients[ident] = Client(ident=ident, heard=now)
        client.heard = now
        if isinstance(frame, Ping):
            self._reply(ident, Pong(nonce=self.nonce))
            return
        if isinstance(frame, Data):
            assert body is not None
            if self.ingress.bytes_per_s is not None:
                self._arrivals.append((ident, frame, body))
                self._arrived.set()
                return
            self._on_data(client, frame, body)
            return
        if isinstance(frame, Cancel):
            offer = self._granted.pop((ident, frame.seq), None)
            if offer is None:
                before = len(self._offers)
                self._offers = deque(
                    (i, o) for i, o in self._offers if (i, o.seq) != (ident, frame.seq)
                )
                if len(self._offers) == before:
                    self.drops["unknown"] += 1
            else:
                client.granted.discard(frame.seq)
                self._release(1, offer.size)
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
        elif frame.key.attempt in self._stopped:
            self._refuse(ident, frame.seq, "stopped", "the attempt was stopped", False)
        elif frame.size > self.config.max_payload_bytes:
            limit = self.config.max_payload_bytes
            self._refuse(ident, frame.seq, "oversized", f"payload above {limit} bytes", False)
        else:
            self._offers.append((ident, frame))

    def _admit(self) -> None:
        """Grant room to waiting offers in arrival order while the buffer has room."""
        while self._offers and self._fits(self._offers[0][1].size):
            ident, offer = self._offers.popleft()
            client = self._clients.get(ident)
            if client is None:
                continue
            self._granted[(ident, offer.seq)] = offer
            client.granted.add(offer.seq)
            self._hold(1, offer.size)
            self._reply(ident, Grant(seq=offer.seq))

    def _on_data(self, client: Client, frame: Data, body: Sized) -> None:
        s = self._stats
        self._stats = TransportStats(
            payloads=s.payloads,
            payload_bytes=s.payload_bytes,
            cross_bytes=s.cross_bytes + frame.size,
        )
        offer = self._granted.pop((client.ident, frame.seq), None)
        if offer is None:
            # Room this root never granted, or released meanwhile (a client silent for
            # peer_timeout_s): the sender, if it still waits, retries in a new attempt.
            self.drops["unknown"] += 1
            self._refuse(client.ident, frame.seq, "lost", "no room was granted for it", True)
            return
        client.granted.discard(frame.seq)
        counts = self._by_attempt.setdefault(offer.key.attempt, [0, 0])
        counts[0] += frame.size
        while len(self._by_attempt) > 1024:
            del self._by_attempt[next(iter(self._by_attempt))]
        if offer.size != frame.size:
            self._release(1, offer.size)
            self.drops["malformed"] += 1
            self._refuse(client.ident, frame.seq, "size", "data size differs from offer", False)
            return
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
            client=(client.ident, frame.seq),
        )
        self._route(t)

    def _forget_client(self, ident: bytes) -> None:
        """The client vanished: release room granted to it and drop its waiting offers."""
        client = self._clients.pop(ident, None)
        if client is None:
            return
        for seq in client.granted:
            offer = self._granted.pop((ident, seq), None)
            if offer is not None:
                self._release(1, offer.size)
        self._offers = deque((i, o) for i, o in self._offers if i != ident)

    async def _ingress_forever(self) -> None:
        """Take payload bytes from owners through the emulated link, one transfer after the
        other in arrival order; control frames do not wait behind them."""
        while True:
            while not self._arrivals:
                self._arrived = anyio.Event()
                await self._arrived.wait()
            ident, frame, body = self._arrivals[0]
            await self.ingress.pace(frame.size)
            self._arrivals.popleft()
            client = self._clients.get(ident)
            if client is None:
                # Forgotten meanwhile: the room it was granted is released; tell it, as for
                # data that arrives after its client was forgotten.
                client = Client(ident=ident, heard=time.monotonic())
            self._on_data(client, frame, body)
            self._admit()
