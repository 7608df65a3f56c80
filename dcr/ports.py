"""Free TCP ports on this host, for processes that bind them later (relay nodes, test servers)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_ports"]


_LOW_PORT = 10000
"""Ports are picked at or above this (below it lie many services' well-known ports)."""


def _ephemeral_range() -> tuple[int, int]:
    """The ports the OS hands out for outgoing connections and port-0 binds (Linux's
    ``ip_local_port_range``; elsewhere the IANA range)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports nothing listens on right now, for a process that binds them
    later (the launcher hands them to relay nodes; tests to their servers).

    They are picked outside the OS's ephemeral range where it leaves room, so that between
    now and that bind no outgoing connection or port-0 bind of any process on the host
    takes one in passing, and a relay node restarted later finds its port free again.
    Where the ephemeral range covers (nearly) every port, they come from it.
    """
    lo, hi = _ephemeral_range()
    if lo - _LOW_PORT >= 1000:
        pool = range(_LOW_PORT, lo)
    elif 65535 - hi >= 1000:
        pool = range(hi + 1, 65536)
    else:
        pool = range(0)
    pick = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(64 * n):
            if len(socks) == n or not pool:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, pick.choice(pool)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # no room outside the ephemeral range: any free port
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1, host)[0]
