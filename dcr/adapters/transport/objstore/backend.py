"""The object store under the object-storage transport: :class:`ObjectBackend`, whole-object
put, get, list and delete under one root, and :class:`ObjectInfo`, one object as a listing
shows it.  A new store is one subclass of :class:`ObjectBackend`; the S3 and directory
backends live in :mod:`dcr.adapters.transport.s3` and :mod:`dcr.adapters.transport.directory`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from dcr.adapters.transport.link import LinkLimit

__all__ = ["ObjectBackend", "ObjectInfo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectInfo:
    """One stored object as a listing shows it."""

    key: str
    size: int
    modified: float
    """When it was last written (seconds since the epoch, the storage's clock)."""


class ObjectBackend(ABC):
    """Whole objects under one root: the primitives the object-storage transport builds on.

    Keys are ``/``-separated paths of segments from ``[A-Za-z0-9._%-]``.  A reader never sees
    part of an object: ``put`` makes it visible whole (an S3 PUT or completed multipart
    upload, a rename of a finished file).  Implementations convert their errors into
    :class:`~dcr.errors.TransportError` and say whether retrying may help.
    """

    @abstractmethod
    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        """Store ``data`` under ``key`` (replacing it), its bytes paced by ``link``."""

    @abstractmethod
    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` when there is no such object."""

    @abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Delete these objects; keys that do not exist are fine."""

    @abstractmethod
    async def abort_uploads(self, prefix: str) -> None:
        """Drop incomplete uploads under ``prefix`` (S3 multipart uploads, temporary files)."""

    def describe(self) -> str:
        """Where the objects live, for messages."""
        return type(self).__name__

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
