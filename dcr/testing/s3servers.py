"""Real S3 servers on 127.0.0.1 for tests: moto's threaded server, and SeaweedFS from the product.

:class:`MotoServer` runs moto's S3 in a thread of this process (starts at once; good for
fast per-test fixtures).  :class:`~dcr.adapters.s3server.SeaweedServer` is a real SeaweedFS
in a child process.  Both are context managers and give an :class:`S3Endpoint`.
"""

from __future__ import annotations

from typing import Any

from dcr.adapters.s3server import S3Endpoint, S3Server, SeaweedServer, s3_environ, weed_binary
from dcr.ports import free_ports

__all__ = [
    "MotoServer",
    "S3Endpoint",
    "SeaweedServer",
    "free_ports",
    "s3_environ",
    "weed_binary",
]


class MotoServer(S3Server):
    """moto's S3 in a thread of this process, on a free 127.0.0.1 port."""

    def __init__(self) -> None:
        self._server: Any = None

    def start(self) -> S3Endpoint:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        port = free_ports(1)[0]
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = S3Endpoint(url=f"http://127.0.0.1:{port}")
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
