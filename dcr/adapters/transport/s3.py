"""The S3 backend (aiobotocore): any S3-compatible store as the object-storage transport.

Objects live in ``bucket`` under ``prefix``; a payload above ``multipart_threshold_mb`` is
uploaded as a multipart object (paper App. B "Transports") in parts of ``part_mb``, up to
``part_concurrency`` at a time, and a failed upload is aborted.  Credentials and region come
from the standard AWS chain (environment, shared config and credentials files, instance
roles); ``endpoint_url`` points the client at another S3 (SeaweedFS, MinIO, moto).  The client
retries nothing itself: every error is converted here into a
:class:`~dcr.errors.TransportError` whose ``retryable`` says whether the transport's backoff
should try again (503 SlowDown and other throttling, 5xx, cut or timed-out connections,
damaged responses) or give up (missing bucket, denied access, bad credentials).

The backend also offers conditional writes (``If-None-Match: *`` to create, ``If-Match:
<etag>`` to replace) for :class:`~dcr.adapters.commit.s3.S3CommitStore`.  aiobotocore is
imported when the first client is made (install it with ``pip install 'dcr[s3]'``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

import anyio

from dcr.adapters.context import construct
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

__all__ = ["S3Backend", "S3Options", "S3Transport", "convert_error"]

MIB = 1 << 20
READ_CHUNK = MIB
DELETE_BATCH = 1000
THROTTLING = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests"}
)
TRANSIENT = frozenset({"RequestTimeout", "InternalError", "ServiceUnavailable"})


@dataclass(frozen=True, slots=True, kw_only=True)
class S3Options:
    """Where the objects live and how the client talks to S3."""

    bucket: str
    prefix: str = "dcr"
    """Key prefix of every object (one fleet's transport, or one policy's commit record)."""
    endpoint_url: str | None = None
    region: str | None = None
    """Region name; ``None`` takes it from the AWS chain (``AWS_DEFAULT_REGION``, config)."""
    profile: str | None = None
    """A named profile of the shared AWS config files; ``None`` for the default chain."""
    addressing_style: str = "auto"
    """``auto``, ``path`` (most self-hosted stores) or ``virtual``."""
    multipart_threshold_mb: float = 64.0
    part_mb: float = 16.0
    part_concurrency: int = 4
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_connections: int = 32

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("the S3 backend needs a bucket")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"addressing_style {self.addressing_style!r}: auto, path, virtual")
        if self.part_mb < 5 or self.multipart_threshold_mb < self.part_mb:
            raise ConfigError(
                "S3 parts are >= 5 MiB and multipart_threshold_mb must be >= part_mb "
                f"(got part_mb={self.part_mb}, multipart_threshold_mb="
                f"{self.multipart_threshold_mb})"
            )
        if self.part_concurrency < 1 or self.max_connections < 1:
            raise ConfigError("part_concurrency and max_connections must be >= 1")


def _status_code(response: dict[str, Any]) -> tuple[int, str]:
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    code = str(response.get("Error", {}).get("Code", ""))
    return status, code


def convert_error(exc: BaseException, what: str) -> TransportError:
    """A vendor error of an S3 call as a :class:`TransportError` (``retryable`` set for
    throttling, 5xx, broken or timed-out connections and damaged responses)."""
    import aiohttp
    from botocore import exceptions as be

    if isinstance(exc, be.ClientError):
        status, code = _status_code(exc.response)
        throttled = code in THROTTLING or status in (429, 503)
        retryable = throttled or status >= 500 or status == 408 or code in TRANSIENT
        return TransportError(
            f"{what}: {code or status} ({exc})",
            retryable=retryable,
            check="throttled" if throttled else "storage",
        )
    connection = (
        be.ConnectionError,
        be.HTTPClientError,
        be.IncompleteReadError,
        be.ResponseStreamingError,
        be.ChecksumError,
        aiohttp.ClientError,
        asyncio.TimeoutError,
        OSError,
    )
    if isinstance(exc, connection):
        return TransportError(f"{what}: {type(exc).__name__}: {exc}", retryable=True,
                              check="connection")  # fmt: skip
    return TransportError(f"{what}: {type(exc).__name__}: {exc}", retryable=False,
                          check="storage")  # fmt: skip


def _vendor_errors() -> tuple[type[BaseException], ...]:
    import aiohttp
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


class S3Backend(ObjectBackend):
    """Objects in an S3 bucket; the client opens on first use, :meth:`aclose` closes it."""

    def __init__(self, options: S3Options) -> None:
        self.options = options
        self.prefix = options.prefix.strip("/")
        self._client: Any = None
        self._stack = contextlib.AsyncExitStack()
        self._lock = anyio.Lock()
        self._errors: tuple[type[BaseException], ...] = ()

    def describe(self) -> str:
        return f"s3://{self.options.bucket}/{self.prefix}"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _unkey(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    async def client(self) -> Any:
        """The aiobotocore S3 client (made on first use)."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                try:
                    from aiobotocore.session import AioSession
                    from botocore.config import Config
                except ImportError as exc:
                    raise ConfigError(
                        "the S3 backend needs aiobotocore (pip install 'dcr[s3]')"
                    ) from exc
                o = self.options
                config = Config(
                    connect_timeout=o.connect_timeout_s,
                    read_timeout=o.read_timeout_s,
                    max_pool_connections=o.max_connections,
                    retries={"total_max_attempts": 1},  # the transport retries, with backoff
                    s3={"addressing_style": o.addressing_style},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                session = AioSession(profile=o.profile)
                try:
                    self._client = await self._stack.enter_async_context(
                        session.create_client(
                            "s3", endpoint_url=o.endpoint_url, region_name=o.region, config=config
                        )
                    )
                except Exception as exc:
                    raise TransportError(f"cannot open an S3 client: {exc}", retryable=False,
                                         check="config") from exc  # fmt: skip
                self._errors = _vendor_errors()
        return self._client

    async def call(self, what: str, op: Callable[[Any], Awaitable[Any]]) -> Any:
        """Run ``op(client)``, converting vendor errors at this boundary."""
        client = await self.client()
        try:
            return await op(client)
        except self._errors as exc:
            raise convert_error(exc, what) from exc

    async def put(self, key: str, data: bytes, *, link: LinkLimit | None = None) -> None:
        o = self.options
        if len(data) >= o.multipart_threshold_mb * MIB:
            await self._multipart(key, data, link)
            return
        if link is not None:
            await link.pace(len(data))
        await self.call(
            f"PUT {key}",
            lambda c: c.put_object(Bucket=o.bucket, Key=self._key(key), Body=data),
        )

    async def _multipart(self, key: str, data: bytes, link: LinkLimit | None) -> None:
        o = self.options
        full = self._key(key)
        created = await self.call(
            f"starting the upload of {key}",
            lambda c: c.create_multipart_upload(Bucket=o.bucket, Key=full),
        )
        upload = created["UploadId"]
        size = int(o.part_mb * MIB)
        parts = [(n + 1, off) for n, off in enumerate(range(0, len(data), size))]
        etags: dict[int, str] = {}
        limiter = anyio.CapacityLimiter(o.part_concurrency)

        async def part(number: int, offset: int) -> None:
            async with limiter:
                body = data[offset : offset + size]
                if link is not None:
                    await link.pace(len(body))
                done = await self.call(
                    f"part {number} of {key}",
                    lambda c: c.upload_part(Bucket=o.bucket, Key=full, UploadId=upload,
                                            PartNumber=number, Body=body),
                )  # fmt: skip
                etags[number] = done["ETag"]

        try:
            async with anyio.create_task_group() as tg:
                for number, offset in parts:
                    tg.start_soon(part, number, offset)
            await self.call(
                f"completing the upload of {key}",
                lambda c: c.complete_multipart_upload(
                    Bucket=o.bucket, Key=full, UploadId=upload,
                    MultipartUpload={"Parts": [{"ETag": etags[n], "PartNumber": n}
                                               for n, _ in parts]},
                ),
            )  # fmt: skip
        except BaseException as exc:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(10),
                contextlib.suppress(TransportError),
            ):
                await self.call(
                    f"aborting the upload of {key}",
                    lambda c: c.abort_multipart_upload(Bucket=o.bucket, Key=full, UploadId=upload),
                )
            if isinstance(exc, BaseExceptionGroup):
                first = _first_transport_error(exc)
                if first is not None:
                    raise first from exc
            raise

    async def get(self, key: str, *, link: LinkLimit | None = None) -> bytes | None:
        o = self.options

        async def read(c: Any) -> bytes | None:
            from botocore.exceptions import ClientError

            try:
                response = await c.get_object(Bucket=o.bucket, Key=self._key(key))
            except ClientError as exc:
                if _status_code(exc.response)[1] in ("NoSuchKey", "404"):
                    return None
                raise
            chunks = []
            async with response["Body"] as body:
                while True:
                    chunk = await body.read(READ_CHUNK)
                    if not chunk:
                        break
                    if link is not None:
                        await link.pace(len(chunk))
                    chunks.append(chunk)
            return b"".join(chunks)

        result: bytes | None = await self.call(f"GET {key}", read)
        return result

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        o = self.options

        async def listing(c: Any) -> builtins.list[ObjectInfo]:
            out = []
            pages = c.get_paginator("list_objects_v2").paginate(
                Bucket=o.bucket, Prefix=self._key(prefix)
            )
            async for page in pages:
                for item in page.get("Contents", ()):
                    out.append(
                        ObjectInfo(
                            key=self._unkey(item["Key"]),
                            size=int(item["Size"]),
                            modified=item["LastModified"].timestamp(),
                        )
                    )
            return out

        result: builtins.list[ObjectInfo] = await self.call(f"LIST {prefix}", listing)
        return result

    async def delete(self, keys: Sequence[str]) -> None:
        o = self.options
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self._key(k)} for k in keys[i : i + DELETE_BATCH]]
            done = await self.call(
                f"DELETE {len(batch)} objects",
                lambda c, b=batch: c.delete_objects(  # type: ignore[misc]
                    Bucket=o.bucket, Delete={"Objects": b, "Quiet": True}
                ),
            )
            errors = done.get("Errors") or []
            if errors:
                first = errors[0]
                raise TransportError(
                    f"DELETE {first.get('Key')}: {first.get('Code')} {first.get('Message')} "
                    f"({len(errors)} objects not deleted)",
                    retryable=True,
                    check="storage",
                )

    async def abort_uploads(self, prefix: str) -> None:
        o = self.options

        async def abort(c: Any) -> None:
            pages = c.get_paginator("list_multipart_uploads").paginate(
                Bucket=o.bucket, Prefix=self._key(prefix)
            )
            async for page in pages:
                for upload in page.get("Uploads", ()):
                    try:
                        await c.abort_multipart_upload(
                            Bucket=o.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                    except self._errors:
                        continue  # finished or aborted meanwhile

        await self.call(f"aborting uploads under {prefix}", abort)

    # -- conditional writes (the S3 commit store) ------------------------------------------

    async def read_versioned(self, key: str) -> tuple[bytes, str] | None:
        """The object and its ETag, or ``None`` when it does not exist."""
        o = self.options

        async def read(c: Any) -> tuple[bytes, str] | None:
            from botocore.exceptions import ClientError

            try:
                response = await c.get_object(Bucket=o.bucket, Key=self._key(key))
            except ClientError as exc:
                if _status_code(exc.response)[1] in ("NoSuchKey", "404"):
                    return None
                raise
            async with response["Body"] as body:
                data = await body.read()
            return data, str(response["ETag"])

        result: tuple[bytes, str] | None = await self.call(f"GET {key}", read)
        return result

    async def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """Write ``data`` only if the object still has ``etag`` (``None``: only if it does
        not exist).  Returns the new ETag, or ``None`` when the condition failed -- 412
        Precondition Failed, 409 ConditionalRequestConflict (a concurrent conditional write),
        or 404 NoSuchKey for ``If-Match`` on a missing object (AWS and moto; SeaweedFS
        answers 412)."""
        o = self.options
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}

        async def write(c: Any) -> str | None:
            from botocore.exceptions import ClientError

            try:
                response = await c.put_object(
                    Bucket=o.bucket, Key=self._key(key), Body=data, **condition
                )
            except ClientError as exc:
                status, code = _status_code(exc.response)
                if status in (409, 412) or code in ("PreconditionFailed", "NoSuchKey"):
                    return None
                raise
            return str(response["ETag"])

        result: str | None = await self.call(f"conditional PUT {key}", write)
        return result

    async def aclose(self) -> None:
        self._client = None
        await self._stack.aclose()


def _first_transport_error(group: BaseExceptionGroup[Any]) -> TransportError | None:
    for exc in group.exceptions:
        if isinstance(exc, TransportError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_transport_error(exc)
            if found is not None:
                return found
    return None


class S3Transport(ObjectStoreTransport):
    """The object-storage transport over S3 (registered as ``s3``).

    Keyword arguments are :class:`S3Options` fields (``bucket`` is required) and
    :class:`~dcr.adapters.transport.objstore.ObjectStoreConfig` fields, e.g.
    ``S3Transport(bucket="rl", prefix="policy-a", endpoint_url="http://...", link_gbps=5)``.
    """

    def __init__(self, *, config: ObjectStoreConfig | None = None, **settings: Any) -> None:
        s3_names = {f.name for f in fields(S3Options)}
        config_names = {f.name for f in fields(ObjectStoreConfig)}
        unknown = set(settings) - s3_names - config_names
        if unknown:
            raise ConfigError(
                f"unknown S3 transport settings {sorted(unknown)}; "
                f"known: {sorted(s3_names | config_names)}"
            )
        transport = {k: v for k, v in settings.items() if k in config_names}
        if config is not None and transport:
            raise ConfigError("give either config or transport settings, not both")
        try:
            options = S3Options(**{k: v for k, v in settings.items() if k in s3_names})
            config = config or ObjectStoreConfig(**transport)
        except TypeError as exc:
            raise ConfigError(f"S3 transport: {exc}") from exc
        super().__init__(S3Backend(options), config)

    @classmethod
    def from_config(cls, options: Mapping[str, Any], context: AdapterContext) -> Self:
        """Every process of a fleet opens the same bucket and prefix: :class:`S3Options` and
        :class:`~dcr.adapters.transport.objstore.ObjectStoreConfig` fields (``bucket`` is
        required); ``node_cache`` as :func:`~dcr.adapters.transport.objstore.fleet_settings`
        says."""
        opts = fleet_settings(options, context, own=[f.name for f in fields(S3Options)])
        return construct(cls, opts, context.section, required=("bucket",))
