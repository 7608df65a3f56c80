"""Files written atomically and durably: a temporary name in the destination directory
(``mkstemp``: unpredictable, created exclusively, never through a link), flushed and fsynced,
renamed over the destination, and the directory fsynced.  A crash leaves the old file or the
new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (renames, new files) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` to ``path`` atomically and durably, with permissions ``mode``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return out
