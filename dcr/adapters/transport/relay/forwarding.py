"""Delivery down the relay tree (paper §7.1, App. B.2): a node routes each payload to the links
with an addressed receiver below them, sends it within each link's credit window and holds it
until every link acknowledged it, then acknowledges it upwards (at the root: answers the owner
``DELIVERED``).  A stop or cleanup of an attempt travels down as a wave: every node drops what
it holds of the attempt and confirms once every link below it confirmed.
"""

from __future__ import annotations

from collections import deque

from dcr.adapters.transport.relay.frames import Ack, Delivered, Done, Payload, Sized, Stop
from dcr.adapters.transport.relay.state import Arrival, Link, NodeState, Transfer, Wave

__all__ = ["Forwarding"]


class Forwarding(NodeState):
    """A relay node's transfers and stop waves (the layer below the root's grants)."""

    # -- transfers --------------------------------------------------------------------------

    def _on_payload(self, frame: Payload, body: Sized) -> None:
        if self._replayed("_last_payload", frame.origin, frame.seq):
            return
        if frame.key.attempt in self._stopped or not self._fits(frame.size):
            # Nothing to deliver (stopped) or a parent that ignored this node's window: the
            # transfer ends here; the receivers' arrival check reports what is missing.
            self.drops["stopped" if frame.key.attempt in self._stopped else "overflow"] += 1
            self._up(Ack(seq=frame.seq))
            return
        self._hold(1, frame.size)
        t = Transfer(
            seq=frame.seq,
            origin=frame.origin,
            key=frame.key,
            to=frame.to,
            body=body,
            size=frame.size,
            client=None,
        )
        self._route(t)

    def _route(self, t: Transfer) -> None:
        """Queue ``t`` on every link with an addressed receiver below it; hold it until all ACK."""
        targets = [
            link
            for link in self._links.values()
            if (link.receivers if t.to is None else link.receivers & t.to)
        ]
        self._transfers[t.seq] = t
        t.waiting = {link.ident for link in targets}
        if not targets:
            self._complete(t)
            return
        for link in targets:
            link.queue.append(t.seq)
        for link in targets:
            self._pump(link)

    def _pump(self, link: Link) -> None:
        """Send queued transfers to ``link`` while its window has room."""
        while link.queue and self._links.get(link.ident) is link:
            t = self._transfers.get(link.queue[0])
            if t is None or link.ident not in t.waiting:
                link.queue.popleft()
                continue
            if not link.has_credit(t.size):
                return
            frame = Payload(origin=t.origin, seq=t.seq, key=t.key, size=t.size, to=t.to)
            if not self._emit(link.ident, frame, t.body):
                # The peer is gone: losing the link releases every transfer waiting for it,
                # this one included (it is still at the head of the queue).
                self._lose(link)
                return
            link.queue.popleft()
            link.inflight[t.seq] = (t.key.attempt, t.size)
            link.inflight_bytes += t.size

    def _complete(self, t: Transfer) -> None:
        if self._transfers.pop(t.seq, None) is None:
            return
        self._release(1, t.size)
        if t.client is None:
            self._up(Ack(seq=t.seq))
        else:
            self._reply(t.client[0], Delivered(seq=t.client[1]))

    def _on_ack(self, link: Link, seq: int) -> None:
        entry = link.inflight.pop(seq, None)
        if entry is None:
            self.drops["unknown"] += 1
            return
        link.inflight_bytes -= entry[1]
        t = self._transfers.get(seq)
        if t is not None and link.ident in t.waiting:
            t.waiting.discard(link.ident)
            if not t.waiting:
                self._complete(t)
        self._pump(link)

    # -- stop and cleanup -------------------------------------------------------------------

    def _start_wave(
        self,
        attempt: int,
        cleanup: bool,
        origin: int,
        seq: int,
        client: tuple[bytes, int] | None,
    ) -> None:
        """Stop ``attempt`` here and below: drop what this node holds of it, refuse it from
        now on, and confirm once every link confirmed (paper App. B.2, stopping an attempt)."""
        self._stopped.add(attempt)
        if cleanup:
            self._seen = {k: v for k, v in self._seen.items() if k.attempt != attempt}
        for t in [t for t in self._transfers.values() if t.key.attempt == attempt]:
            del self._transfers[t.seq]
            self._release(1, t.size)
            if t.client is not None:
                self._refuse(t.client[0], t.client[1], "stopped", "the attempt was stopped", False)
        for key in [k for k, g in self._granted.items() if g.offer.key.attempt == attempt]:
            granted = self._take_grant(*key)
            if granted is None:
                continue
            self._release(1, granted.offer.size)
            self._refuse(key[0], key[1], "stopped", "the attempt was stopped", False)
        for arrival in self._arrivals:
            if not arrival.dropped and arrival.offer.key.attempt == attempt:
                self._drop_arrival(arrival)
                self._refuse(
                    arrival.client.ident, arrival.frame.seq, "stopped",
                    "the attempt was stopped", False,
                )  # fmt: skip
        waiting = [(i, o) for i, o in self._offers if o.key.attempt == attempt]
        self._offers = deque((i, o) for i, o in self._offers if o.key.attempt != attempt)
        for ident, offer in waiting:
            self._offer_gone(ident)
            self._refuse(ident, offer.seq, "stopped", "the attempt was stopped", False)
        wave = Wave(seq=seq, attempt=attempt, client=client)
        frame = Stop(origin=origin, seq=seq, attempt=attempt, cleanup=cleanup)
        lost = []
        for link in list(self._links.values()):
            if self._emit(link.ident, frame):
                wave.waiting.add(link.ident)
            else:
                lost.append(link)
        self._waves[seq] = wave
        for link in lost:
            self._lose(link)
        if not wave.waiting:
            self._finish(wave)

    def _drop_arrival(self, arrival: Arrival) -> None:
        """Granted data behind the root's link is not taken after all: release its room."""
        arrival.dropped = True
        arrival.body = b""
        arrival.client.budget.granted_bytes -= arrival.offer.size
        self._release(1, arrival.offer.size)

    def _finish(self, wave: Wave) -> None:
        if self._waves.pop(wave.seq, None) is None:
            return
        if wave.client is None:
            self._up(Done(seq=wave.seq))
        else:
            self._reply(wave.client[0], Done(seq=wave.client[1]))

    def _on_done(self, link: Link, seq: int) -> None:
        wave = self._waves.get(seq)
        if wave is None or link.ident not in wave.waiting:
            self.drops["unknown"] += 1
            return
        # The link dropped everything of the attempt before it confirmed: its window is free.
        for tid, (attempt, size) in list(link.inflight.items()):
            if attempt == wave.attempt:
                del link.inflight[tid]
                link.inflight_bytes -= size
        wave.waiting.discard(link.ident)
        self._pump(link)
        if not wave.waiting:
            self._finish(wave)
