"""Run a command inside the private network namespace it was started in (``unshare -n``, as
root), with the loopback interface brought up first: a Ray cluster started there stays on
127.0.0.1 (Ray binds every interface and talks to the machine's own address otherwise).  What
``dcr rl --backend ray``, the Ray examples and dcr's Ray tests run in on a shared machine:

    unshare -n python -m dcr.ray.netns dcr rl --backend ray
    unshare -n python -m dcr.ray.netns python -m pytest tests/ray
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

__all__ = ["loopback_up", "only_loopback"]

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def only_loopback() -> bool:
    """Whether this process's network namespace has no interface but ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def loopback_up() -> None:
    """Bring ``lo`` up (a fresh network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: unshare -n python -m dcr.ray.netns COMMAND [ARG...]", file=sys.stderr)
        return 2
    if not only_loopback():
        print("dcr.ray.netns: not in a private network namespace (run it under "
              "`unshare -n`)", file=sys.stderr)  # fmt: skip
        return 2
    loopback_up()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
