"""Real S3 servers for the adapter tests, started and stopped here: moto's threaded server
(fast) and SeaweedFS (a real server binary).  Clients find the credentials through the
standard AWS chain, so the session's environment carries them (and disables the instance
metadata service)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dcr.testing.s3servers import MotoServer, S3Endpoint, SeaweedServer, s3_environ


@pytest.fixture(scope="session")
def aws_environ() -> Iterator[None]:
    """The test credentials in this process's environment for the whole session."""
    env = s3_environ("dcr-test-access", "dcr-test-secret")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def moto_s3(aws_environ: None) -> Iterator[S3Endpoint]:
    with MotoServer() as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def seaweed_s3(aws_environ: None) -> Iterator[S3Endpoint]:
    with SeaweedServer() as server:
        yield server.endpoint
