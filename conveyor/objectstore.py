"""Object store: a local directory or any S3-compatible endpoint (boto3).

Both implementations satisfy one contract (tests/integration/test_objectstore_contract.py):

- ``put`` is atomic: a reader sees the old object or the new one, never half.
- ``put_if_absent`` writes only if the key does not exist and says whether it
  wrote; two racing writers cannot both win (S3 ``If-None-Match: *``, local
  ``link(2)``). The storage sink and checkpoints rely on it.
- Every object carries a SHA-256; ``get(key, sha256=...)`` verifies it and
  raises :class:`ChecksumMismatch` rather than return corrupt bytes.
- Large objects (``put_file``) go up in parts.
- ``list`` is sorted by key, so iteration over a prefix is deterministic.

Usage::

    store = open_object_store(cfg.object_store)
    info = store.put("runs/r1/manifest.json", b"{}")
    data = store.get("runs/r1/manifest.json", sha256=info.sha256)
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from conveyor.errors import ChecksumMismatch, ConveyorError, RetryableError

if TYPE_CHECKING:
    from conveyor.config import LocalStoreConfig, S3StoreConfig


class ObjectNotFound(ConveyorError, KeyError):
    """No object under that key."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want prose
        return str(self.args[0]) if self.args else "object not found"


class ObjectStoreUnavailable(RetryableError):
    """The store could not be reached after the configured retries."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    sha256: str | None  # None when the object was written by someone else without one


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"invalid object key {key!r}: must be non-empty, relative, and not end with '/'")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' path segment")
    return key


def _verify(key: str, data: bytes, expected: str | None) -> bytes:
    if expected is not None:
        actual = sha256_hex(data)
        if actual != expected:
            raise ChecksumMismatch(f"object {key}: sha256 {actual} does not match expected {expected}")
    return data


class ObjectStore(Protocol):
    def uri(self, key: str) -> str: ...
    def table_location(self, prefix: str) -> tuple[str, dict[str, str]]: ...
    def put(self, key: str, data: bytes) -> ObjectInfo: ...
    def put_if_absent(self, key: str, data: bytes, *, sha256: str | None = None) -> bool: ...
    def put_file(self, key: str, path: str | Path) -> ObjectInfo: ...
    def get(self, key: str, *, sha256: str | None = None) -> bytes: ...
    def get_file(self, key: str, path: str | Path) -> ObjectInfo: ...
    def head(self, key: str) -> ObjectInfo: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...


# --------------------------------------------------------------------------
# local directory


class LocalObjectStore:
    """Objects as files under ``root``; the checksum lives in a sidecar file.

    Writes go to a temporary file in the same directory, are fsynced, then
    renamed (``put``) or hard-linked (``put_if_absent``, which fails if the
    name exists), so readers never see a partial object.
    """

    _SIDECAR = ".sha256"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def uri(self, key: str) -> str:
        return (self.root / _check_key(key)).as_uri()

    def table_location(self, prefix: str) -> tuple[str, dict[str, str]]:
        """The URI and storage options a table format's library (delta-rs) opens ``prefix`` with."""
        return (self.root / _check_key(prefix.rstrip("/"))).as_uri(), {}

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _write_temp(self, path: Path, chunks: Iterator[bytes]) -> tuple[Path, int, str]:
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in chunks:
                    fh.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp), size, digest.hexdigest()

    def _write_sidecar(self, path: Path, sha: str) -> None:
        side = path.with_name(path.name + self._SIDECAR)
        tmp = side.with_name(f".tmp-{os.getpid()}-{side.name}")
        tmp.write_text(sha)
        os.replace(tmp, side)

    def put(self, key: str, data: bytes) -> ObjectInfo:
        path = self._path(key)
        tmp, size, sha = self._write_temp(path, iter([data]))
        self._write_sidecar(path, sha)
        os.replace(tmp, path)
        return ObjectInfo(key, size, sha)

    def put_if_absent(self, key: str, data: bytes, *, sha256: str | None = None) -> bool:
        # The digest is computed while the bytes are written anyway; a caller's is not needed.
        path = self._path(key)
        tmp, _, sha = self._write_temp(path, iter([data]))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        self._write_sidecar(path, sha)
        return True

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        target = self._path(key)

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    yield chunk

        tmp, size, sha = self._write_temp(target, chunks())
        self._write_sidecar(target, sha)
        os.replace(tmp, target)
        return ObjectInfo(key, size, sha)

    def _sidecar_sha(self, path: Path) -> str | None:
        try:
            return path.with_name(path.name + self._SIDECAR).read_text().strip() or None
        except FileNotFoundError:
            return None

    def get(self, key: str, *, sha256: str | None = None) -> bytes:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise ObjectNotFound(f"no object {key} in {self.root}") from None
        return _verify(key, data, sha256 if sha256 is not None else self._sidecar_sha(path))

    def get_file(self, key: str, path: str | Path) -> ObjectInfo:
        data = self.get(key)
        Path(path).write_bytes(data)
        return ObjectInfo(key, len(data), sha256_hex(data))

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no object {key} in {self.root}")
        return ObjectInfo(key, path.stat().st_size, self._sidecar_sha(path))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.with_name(path.name + self._SIDECAR).unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        keys = []
        # Walk only the prefix's directory: the learner lists its weights at every publication,
        # and a store shared by many runs (the demo's runs/objects) must not make that slower.
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.resolve().is_relative_to(self.root.resolve()):
            return
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-") or name.endswith(self._SIDECAR):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        for key in sorted(keys):
            try:
                yield self.head(key)
            except ObjectNotFound:  # deleted while listing
                continue


# --------------------------------------------------------------------------
# S3


class S3ObjectStore:
    """S3 through boto3: endpoint, credentials, TLS and retries from config.

    The SHA-256 travels as user metadata (``x-amz-meta-sha256``). boto3's own
    flexible checksums are set to "when required", because several
    S3-compatible servers reject the CRC trailers newer boto3 sends by default.
    An ``http://`` endpoint on another machine works but is warned about
    (``s3.plaintext_endpoint``): objects and weights cross the network in clear.
    """

    def __init__(self, cfg: S3StoreConfig) -> None:
        from urllib.parse import urlsplit

        import boto3
        import structlog
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        from conveyor.backend_config import is_loopback_host

        self.cfg = cfg
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        endpoint = urlsplit(cfg.endpoint_url or "")
        if endpoint.scheme == "http" and not is_loopback_host(endpoint.hostname):
            structlog.get_logger(__name__).warning(
                "s3.plaintext_endpoint",
                endpoint=cfg.endpoint_url,
                advice="use https:// (object_store.ca_bundle for a private CA)",
            )
        self._client = boto3.client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            region_name=cfg.region,
            aws_access_key_id=cfg.access_key_id,
            aws_secret_access_key=cfg.secret_access_key.get_secret_value() if cfg.secret_access_key else None,
            verify=str(cfg.ca_bundle) if cfg.ca_bundle is not None else cfg.verify_tls,
            config=Config(
                retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=cfg.multipart_threshold_bytes,
            multipart_chunksize=cfg.multipart_chunk_bytes,
            use_threads=True,
        )
        if cfg.create_bucket:
            self._ensure_bucket()

    # -- helpers
    def _key(self, key: str) -> str:
        return self.prefix + _check_key(key)

    def _call(self, fn, /, **kwargs):
        from botocore.exceptions import ClientError, ConnectionError, EndpointConnectionError, ReadTimeoutError

        try:
            return fn(**kwargs)
        except (EndpointConnectionError, ConnectionError, ReadTimeoutError) as exc:
            raise ObjectStoreUnavailable(f"S3 at {self.cfg.endpoint_url or 'AWS'} unavailable: {exc}") from exc
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"):
                raise ObjectStoreUnavailable(f"S3 error {code} ({status}): {exc}") from exc
            raise

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call(self._client.head_bucket, Bucket=self.bucket)
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
            try:
                self._call(self._client.create_bucket, Bucket=self.bucket)
            except ClientError as exc2:
                if exc2.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    @staticmethod
    def _not_found(exc: Exception) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        return exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")

    # -- contract
    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def table_location(self, prefix: str) -> tuple[str, dict[str, str]]:
        """The URI and storage options a table format's library (delta-rs) opens ``prefix`` with:
        the same endpoint, credentials and timeouts as this client. Commits use S3 conditional
        writes (``If-None-Match``), which AWS and the local stack's server honour: no lock service."""
        cfg = self.cfg
        opts = {
            "AWS_REGION": cfg.region,
            "conditional_put": "etag",
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
            "connect_timeout": f"{cfg.connect_timeout_s}s",
            "timeout": f"{cfg.read_timeout_s}s",
        }
        if cfg.endpoint_url:
            opts["AWS_ENDPOINT_URL"] = cfg.endpoint_url
            if cfg.endpoint_url.startswith("http://"):
                opts["AWS_ALLOW_HTTP"] = "true"
        if cfg.access_key_id:
            opts["AWS_ACCESS_KEY_ID"] = cfg.access_key_id
        if cfg.secret_access_key is not None:
            opts["AWS_SECRET_ACCESS_KEY"] = cfg.secret_access_key.get_secret_value()
        if not cfg.verify_tls:
            opts["allow_invalid_certificates"] = "true"
        return f"s3://{self.bucket}/{self._key(prefix.rstrip('/'))}", opts

    def put(self, key: str, data: bytes) -> ObjectInfo:
        sha = sha256_hex(data)
        if len(data) >= self.cfg.multipart_threshold_bytes:
            self._upload(key, io.BytesIO(data), sha)
        else:
            self._call(self._client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data, Metadata={"sha256": sha})
        return ObjectInfo(key, len(data), sha)

    def put_if_absent(self, key: str, data: bytes, *, sha256: str | None = None) -> bool:
        """``sha256``: the caller's hex digest of ``data`` when it has one (the lake's writer
        does, for its manifest), so a large part is not hashed twice; stored as given."""
        from botocore.exceptions import ClientError

        try:
            self._call(
                self._client.put_object,
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                Metadata={"sha256": sha256 or sha256_hex(data)},
                IfNoneMatch="*",
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return False
            raise
        return True

    def _upload(self, key: str, fileobj, sha: str) -> None:
        self._call(
            self._client.upload_fileobj,
            Fileobj=fileobj,
            Bucket=self.bucket,
            Key=self._key(key),
            ExtraArgs={"Metadata": {"sha256": sha}},
            Config=self._transfer,
        )

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                digest.update(chunk)
        sha = digest.hexdigest()
        with open(path, "rb") as fh:
            self._upload(key, fh, sha)
        return ObjectInfo(key, Path(path).stat().st_size, sha)

    def get(self, key: str, *, sha256: str | None = None) -> bytes:
        try:
            resp = self._call(self._client.get_object, Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if self._not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise
        data = resp["Body"].read()
        expected = sha256 if sha256 is not None else resp.get("Metadata", {}).get("sha256")
        return _verify(key, data, expected)

    def get_file(self, key: str, path: str | Path) -> ObjectInfo:
        info = self.head(key)
        try:
            self._call(
                self._client.download_file, Bucket=self.bucket, Key=self._key(key), Filename=str(path), Config=self._transfer
            )
        except Exception as exc:
            if self._not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise
        if info.sha256:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != info.sha256:
                raise ChecksumMismatch(f"object {key}: downloaded file does not match its sha256")
        return info

    def head(self, key: str) -> ObjectInfo:
        try:
            resp = self._call(self._client.head_object, Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            if self._not_found(exc):
                raise ObjectNotFound(f"no object {self.uri(key)}") from None
            raise
        return ObjectInfo(key, resp["ContentLength"], resp.get("Metadata", {}).get("sha256"))

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        self._call(self._client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        full_prefix = self.prefix + prefix
        for page in self._call(paginator.paginate, Bucket=self.bucket, Prefix=full_prefix):
            for obj in page.get("Contents", []):
                # ListObjects carries no user metadata; sha256 needs a head().
                yield ObjectInfo(obj["Key"][len(self.prefix) :], obj["Size"], None)


def open_object_store(cfg: LocalStoreConfig | S3StoreConfig) -> ObjectStore:
    if cfg.type == "local":
        return LocalObjectStore(cfg.root)
    if cfg.type == "s3":
        return S3ObjectStore(cfg)
    raise ValueError(f"unknown object store type {cfg.type!r}")


async def wait_for_object_store(cfg: LocalStoreConfig | S3StoreConfig, *, first_delay_s: float = 0.5,
                                max_delay_s: float = 5.0) -> ObjectStore:  # fmt: skip
    """``open_object_store`` for a service starting up: while the endpoint is unavailable, retry
    with backoff until ``cfg.connect_deadline_s`` (S3; a local store opens at once), then raise
    the last ``ObjectStoreUnavailable``. A service started during an S3 outage waits for it
    instead of crash-looping (and a stop signal still ends the wait); any other error (bad
    credentials, a bucket that cannot be created) fails at once."""
    import asyncio

    from conveyor.runtime import retry_until

    return await retry_until(
        "open", lambda: asyncio.to_thread(open_object_store, cfg), getattr(cfg, "connect_deadline_s", 0.0),
        retriable=lambda exc: isinstance(exc, ObjectStoreUnavailable), event="object_store.waiting",
        first_delay_s=first_delay_s, max_delay_s=max_delay_s,
    )  # fmt: skip
