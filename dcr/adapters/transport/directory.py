"""The directory backend: a local or shared directory (NFS, Lustre) as the object store.

The embedded default object store for one host (and, on a shared filesystem, across hosts).
Each object is a file under the root, its key the relative path.  ``put`` writes a new
temporary file next to the target (an unpredictable name, created exclusively and never
through a symbolic link planted there), fsyncs it (so a reader on another client of a shared
filesystem sees complete bytes) and renames it into place, so readers see an object whole or
not at all; temporary files are never listed, and ``abort_uploads`` removes those a dead
writer left.
Directories emptied by ``delete`` are removed.  File I/O runs in worker threads.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio

from dcr.adapters.context import dataclass_options
from dcr.adapters.transport.link import LinkLimit
from dcr.adapters.transport.objstore import (
    ObjectBackend,
    ObjectInfo,
    ObjectStoreConfig,
    ObjectStoreTransport,
    fleet_settings,
)
from dcr.errors import ConfigError, TransportError

if TYPE_CHECKING:
    from dcr.adapters.context import AdapterContext

__all__ = ["DirectoryBackend", "DirectoryTransport"]

TMP = ".tmp-"
"""Prefix of temporary file names (never part of a key: keys have no leading dot)."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_CHUNK = 4 << 20
_SEGMENT = re.compile(r"^[A-Za-z0-9_%-][A-Za-z0-9._%-]*$")
_RETRYABLE = {errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ESTALE, errno.ETIMEDOUT, errno.EIO}
"""Errors a shared filesystem gives transiently (NFS: stale handles, timeouts)."""


def _error(exc: OSError, what: str) -> TransportError:
    return TransportError(f"{what}: {exc}", retryable=exc.errno in _RETRYABLE, check="storage")


class DirectoryBackend(ObjectBackend):
    """Objects as files under ``root``; ``fsync=False`` skips the flush before each rename
    (faster on a local disk, where the page cache is already shared)."""

    def __init__(self, root: str | Path, *, fsync: bool = True) -> None:
        self.root = Path(root).resolve()
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the object directory {self.root}: {exc}") from exc

    def describe(self) -> str:
        return f"directory {self.root}"

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not all(_SEGMENT.match(p) for p in parts):
            raise TransportError(f"invalid object key {key!r}", retryable=False, check="key")
        return self.root.joinpath(*parts)

    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        path = self._path(key)
        if link is not None:
            await link.pace(len(data))
        await anyio.to_thread.run_sync(self._write, path, data)

    def _write(self, path: Path, data: bytes) -> None:
        for _ in range(3):  # a concurrent delete may remove the emptied parent: make it again
            tmp = path.parent / f"{TMP}{secrets.token_hex(16)}-{path.name}"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # A new file of an unpredictable name, never one a link planted there names.
                fd = os.open(tmp, _CREATE, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                continue
            except OSError as exc:
                _unlink(tmp)
                raise _error(exc, f"writing {path}") from exc
        raise TransportError(f"writing {path}: its directory keeps vanishing", retryable=True,
                             check="storage")  # fmt: skip

    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        path = self._path(key)
        try:
            f = await anyio.to_thread.run_sync(open, path, "rb")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _error(exc, f"reading {path}") from exc
        chunks = []
        try:
            while True:
                chunk = await anyio.to_thread.run_sync(f.read, READ_CHUNK)
                if not chunk:
                    break
                if link is not None:
                    await link.pace(len(chunk))
                chunks.append(chunk)
        except OSError as exc:
            raise _error(exc, f"reading {path}") from exc
        finally:
            f.close()
        return b"".join(chunks)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await anyio.to_thread.run_sync(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[ObjectInfo]:
        top = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(top) if top else self.root
        out: builtins.list[ObjectInfo] = []
        stack = [start]
        while stack:
            here = stack.pop()
            try:
                entries = list(os.scandir(here))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise _error(exc, f"listing {here}") from exc
            for e in entries:
                if e.name.startswith(TMP):
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted meanwhile
                key = Path(e.path).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    async def delete(self, keys: Sequence[str]) -> None:
        paths = [self._path(k) for k in keys]
        await anyio.to_thread.run_sync(self._delete, paths)

    def _delete(self, paths: builtins.list[Path]) -> None:
        parents = set()
        for path in paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _error(exc, f"deleting {path}") from exc
            parents.add(path.parent)
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            self._prune(parent)

    def _prune(self, directory: Path) -> None:
        """Remove ``directory`` and its parents up to the root while they are empty."""
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (or gone): stop here
            directory = directory.parent

    async def abort_uploads(self, prefix: str) -> None:
        await anyio.to_thread.run_sync(self._abort, prefix)

    def _abort(self, prefix: str) -> None:
        top = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(top) if top else self.root
        for dirpath, _, files in os.walk(start):
            for name in files:
                if name.startswith(TMP):
                    _unlink(Path(dirpath) / name)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


class DirectoryTransport(ObjectStoreTransport):
    """The object-storage transport over a directory (registered as ``directory``).

    ``path`` is the directory (created if needed; every process of a fleet names the same
    one).  Without a path the transport makes a temporary directory of its own and removes it
    when closed (one process, e.g. :class:`~dcr.LocalRefit`).  The other keyword arguments
    are :class:`~dcr.adapters.transport.objstore.ObjectStoreConfig` fields.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        fsync: bool = True,
        config: ObjectStoreConfig | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise ConfigError("give either config or settings, not both")
        self._owned = path is None
        root = Path(tempfile.mkdtemp(prefix="dcr-objects-")) if path is None else Path(path)
        try:
            config = config or ObjectStoreConfig(**settings)
        except TypeError as exc:
            raise ConfigError(f"directory transport: {exc}") from exc
        super().__init__(DirectoryBackend(root, fsync=fsync), config)
        self.path = root

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """Every process of a fleet opens the same directory: ``path`` (relative to the fleet
        file; default ``<run_dir>/objects``).  ``fsync`` and the
        :class:`~dcr.adapters.transport.objstore.ObjectStoreConfig` fields are settings;
        ``node_cache`` as :func:`~dcr.adapters.transport.objstore.fleet_settings` says."""
        opts = fleet_settings(options, context, own=("path", "fsync"))
        path = opts.pop("path", None)
        root = context.path(path) if path is not None else context.run_dir / "objects"
        fsync = opts.pop("fsync", True)
        if not isinstance(fsync, bool):
            raise ConfigError(f"[{context.section}]: fsync must be true or false, got {fsync!r}")
        config = dataclass_options(ObjectStoreConfig, opts, context.section)
        return cls(root, fsync=fsync, config=config)

    async def aclose(self) -> None:
        await super().aclose()
        if self._owned:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(self.path, ignore_errors=True))
