"""Temporary files of the directory backend and of a node's shared fetches cannot be
redirected: each is a new file of an unpredictable name, created exclusively and never through
a symbolic link (``O_CREAT | O_EXCL | O_NOFOLLOW``), and a link planted where a published copy
belongs is never read through.  A link planted at a name a writer would use leaves its target
untouched and the object written and read correctly."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import anyio
import pytest

from dcr.adapters.transport.directory import TMP, DirectoryBackend
from dcr.adapters.transport.nodeshare import NodeFetches
from dcr.errors import TransportError

KEY = "dcr/attempt-00000000000000000001/payload/o0/w/0"
PAYLOAD = b"the payload" * 100


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the shared directories that a planted link points at."""
    path = tmp_path / "victim"
    path.write_bytes(b"not yours to write")
    return path


def _links(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_symlink())


def test_a_link_at_the_old_temporary_name_of_a_shared_fetch_is_not_followed(
    tmp_path: Path, victim: Path
) -> None:
    """The copy used to be written through ``<digest>.<pid>.tmp``: a name any local user
    could plant a link at, and have the payload written into the link's target."""
    fetches = NodeFetches(tmp_path / "node")
    published = fetches._path(KEY)
    planted = published.with_name(f"{published.name}.{os.getpid()}.tmp")
    planted.symlink_to(victim)

    async def fetch() -> bytes:
        return PAYLOAD

    assert anyio.run(fetches.get, KEY, fetch) == (PAYLOAD, True)
    assert victim.read_bytes() == b"not yours to write"
    assert not published.is_symlink() and published.read_bytes() == PAYLOAD
    # Another process of the node reads the published copy, not the link's target.
    assert anyio.run(NodeFetches(tmp_path / "node").get, KEY, fetch) == (PAYLOAD, False)
    assert [p.name for p in (tmp_path / "node").iterdir() if p.name.endswith(".tmp")] == [
        planted.name
    ]  # only the planted link is left; nothing of dcr's


def test_a_link_where_a_shared_copy_belongs_is_never_read_through(
    tmp_path: Path, victim: Path
) -> None:
    fetches = NodeFetches(tmp_path / "node")
    published = fetches._path(KEY)
    published.symlink_to(victim)
    downloads = []

    async def fetch() -> bytes:
        downloads.append(1)
        return PAYLOAD

    assert anyio.run(fetches.get, KEY, fetch) == (PAYLOAD, True)
    assert downloads == [1]
    assert victim.read_bytes() == b"not yours to write"
    assert not published.is_symlink() and published.read_bytes() == PAYLOAD


def test_a_guessed_temporary_name_refuses_the_write_instead_of_following_the_link(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a name guessed right (here: the random source fixed) cannot redirect a write:
    the file is created exclusively and not through a link, so the write fails instead."""
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: "0" * 32)
    fetches = NodeFetches(tmp_path / "node")
    published = fetches._path(KEY)
    published.with_name(f"{published.name}.{'0' * 32}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        fetches._publish(published, PAYLOAD)
    backend = DirectoryBackend(tmp_path / "objects", fsync=False)
    target = backend._path(KEY)
    target.parent.mkdir(parents=True)
    (target.parent / f"{TMP}{'0' * 32}-{target.name}").symlink_to(victim)
    with pytest.raises(TransportError, match="writing"):
        anyio.run(backend.put, KEY, PAYLOAD)
    assert victim.read_bytes() == b"not yours to write"
    assert not target.exists()


def test_the_directory_backend_writes_through_no_planted_link(tmp_path: Path, victim: Path) -> None:
    """Links at the object's own path and at temporary-looking names beside it: the object
    replaces the link at its path, the targets stay as they were, and the links at the other
    names are neither listed nor followed."""
    backend = DirectoryBackend(tmp_path / "objects")
    target = backend._path(KEY)
    target.parent.mkdir(parents=True)
    target.symlink_to(victim)
    for guess in (f"{TMP}{target.name}", f"{TMP}0-{target.name}", f"{TMP}{'0' * 32}"):
        (target.parent / guess).symlink_to(victim)
    anyio.run(backend.put, KEY, PAYLOAD)
    assert victim.read_bytes() == b"not yours to write"
    assert not target.is_symlink() and target.read_bytes() == PAYLOAD
    assert anyio.run(backend.get, KEY) == PAYLOAD
    assert [o.key for o in anyio.run(backend.list, "dcr/")] == [KEY]
    written = [p.name for p in target.parent.iterdir() if not p.is_symlink()]
    assert written == [target.name]  # no temporary file left
