"""Per-peer bounds of a relay node (``RelayConfig``, "Per peer"): what each peer -- one key with
keys, one connection without -- may cost, grants that time out, and refusing a peer.

Every frame a node's ROUTER receives is charged to its peer's :class:`~dcr.adapters.transport.
relay.state.Budget`: the frames of it the node dropped and the data it sent without a grant
(both per ``peer_timeout_s`` window), and its offers waiting or granted.  A peer over a bound,
or one whose granted offer saw no data for ``grant_timeout_s``, is *refused*: ZeroMQ has no
per-peer disconnect, so the node drops its state (its clients' waiting offers and granted room,
its links), tells its pending requests so, counts it in ``peers_refused`` and ignores its
frames for ``peer_cooloff_s``.  With keys the cool-off holds for the key, whatever connection
it comes back on.
"""

from __future__ import annotations

import logging

from dcr.adapters.transport.relay.frames import Refused
from dcr.adapters.transport.relay.grants import Grants
from dcr.adapters.transport.relay.state import Budget, Client

__all__ = ["Guard"]

log = logging.getLogger(__name__)

_NOT_THE_PEERS = frozenset({"unsent"})
"""Drops a frame's handling may count that are not its sender's doing (a full parent link)."""


class Guard(Grants):
    """Per-peer bounds, grant timeouts and refusing a peer (the layer below
    :class:`~dcr.adapters.transport.relay.node.RelayNode`)."""

    def _peer_drops(self) -> int:
        return sum(n for reason, n in self.drops.items() if reason not in _NOT_THE_PEERS)

    def _cooling(self, key: str, now: float) -> bool:
        """Whether peer ``key`` was refused less than ``peer_cooloff_s`` ago."""
        until = self._cooloff.get(key)
        if until is None:
            return False
        if now < until:
            return True
        del self._cooloff[key]
        return False

    def _window(self, budget: Budget, now: float) -> None:
        """Start a new ``peer_timeout_s`` window of the peer's drops and ungranted bytes."""
        if now - budget.since > self.config.peer_timeout_s:
            budget.since = now
            budget.drops = budget.ungranted = 0

    def _client(self, ident: bytes, budget: Budget, now: float) -> Client | None:
        """The client of connection ``ident`` (``None``: the node tracks ``max_peers``)."""
        client = self._clients.get(ident)
        if client is None:
            if len(self._clients) + len(self._links) >= self.config.max_peers:
                return None
            client = self._clients[ident] = Client(ident=ident, heard=now, budget=budget)
            budget.users += 1
        return client

    def _check(self, budget: Budget, now: float) -> None:
        """Refuse the peer if it is over one of its bounds."""
        config = self.config
        if budget.over is not None:
            self._refuse_peer(budget, budget.over, now)
        elif budget.ungranted > config.peer_ungranted_bytes:
            self._refuse_peer(budget, "ungranted", now)
        elif budget.drops > config.max_peer_drops:
            self._refuse_peer(budget, "drops", now)

    def _refuse_peer(self, budget: Budget, reason: str, now: float) -> None:
        """Logically disconnect the peer of ``budget``: drop its state, tell its pending
        requests, ignore its frames for ``peer_cooloff_s``."""
        self.peers_refused[reason] += 1
        log.warning(
            "relay node %s refused peer %s (%s) for %s s",
            self.name, budget.key, reason, self.config.peer_cooloff_s,
        )  # fmt: skip
        message = f"this peer went over its bound ({reason}) and is refused for a while"
        for ident, client in list(self._clients.items()):
            if client.budget is not budget:
                continue
            seqs = sorted(client.granted) + [o.seq for i, o in self._offers if i == ident]
            for seq in seqs:
                self._emit(ident, Refused(seq=seq, retryable=True, check="refused",
                                          reason=message))  # fmt: skip
            self._forget_client(ident)
        for link in list(self._links.values()):
            if link.budget is budget:
                self._lose(link)
        if self._budgets.get(budget.key) is budget:
            del self._budgets[budget.key]
        if len(self._cooloff) >= self.config.max_peers:
            self._cooloff = {k: t for k, t in self._cooloff.items() if t > now}
            while len(self._cooloff) >= self.config.max_peers:
                del self._cooloff[min(self._cooloff, key=self._cooloff.__getitem__)]
        self._cooloff[budget.key] = now + self.config.peer_cooloff_s

    def _expire_grants(self, now: float) -> None:
        """Reclaim granted room whose data did not come: ``grant_timeout_s`` after the grant or
        the peer's last data, whichever is later (plus the payload's time on an emulated
        link); the peer is refused."""
        timeout, rate = self.config.grant_timeout_s, self.ingress.bytes_per_s
        late: dict[int, Budget] = {}
        for (ident, seq), granted in list(self._granted.items()):
            client = self._clients.get(ident)
            if client is None:
                continue
            budget = client.budget
            extra = granted.offer.size / rate if rate else 0.0
            if now - max(granted.at, budget.progress) <= timeout + extra:
                continue
            if self._take_grant(ident, seq) is None:
                continue  # released meanwhile (its client was forgotten)
            self.grants_expired += 1
            self._release(1, granted.offer.size)
            self._refuse(
                ident, seq, "grant-timeout",
                f"its data did not arrive within {timeout} s of the grant", True,
            )  # fmt: skip
            late[id(budget)] = budget
        for budget in late.values():
            if self._budgets.get(budget.key) is budget:
                self._refuse_peer(budget, "grant-timeout", now)

    def _collect(self, now: float) -> None:
        """Forget budgets of peers that left, and cool-offs that ended."""
        timeout = self.config.peer_timeout_s
        for key, budget in list(self._budgets.items()):
            if (
                budget.users <= 0
                and budget.offers <= 0
                and budget.granted_bytes <= 0
                and now - budget.since > timeout
            ):
                del self._budgets[key]
        self._cooloff = {k: t for k, t in self._cooloff.items() if t > now}
