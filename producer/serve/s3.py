"""S3-compatible file storage of `qbatch serve` (`--storage s3://bucket/prefix`): the
`storage.FileStore` interface on boto3 (extra `serve`; imported only for an s3:// URL).

Objects under the prefix::

    files/{file_id}.data   the bytes
    files/{file_id}.json   the metadata (as LocalStorage's .json)
    tenants/{hash}/...     each tenant's listing index (empty objects; `file_index`)
    sizes/{hash}/...       each tenant's file sizes (empty objects; the storage quota)
    expiring/...           files with an `expires_after` policy, by time

Uploads are **spooled to a local temp file** (`tmp`, a private temp directory), counted
as they come exactly as LocalStorage does, and sent with boto3's managed transfer
(`upload_file`: multipart above 8 MiB, parts in parallel) only once complete. Why not a
multipart upload straight from the request: the route checks the whole file is JSONL
before it is stored, which needs the bytes again (from S3 that is a second download);
an oversize or invalid upload then never reaches the bucket (no multipart upload to
abort, no orphan parts billed); and the temp file bounds memory like the local backend.
The cost is local disk up to the upload limit per concurrent upload.

The data object is written first and the metadata last; S3 writes are atomic per object
and read-after-write consistent, so a file is listed exactly when it is complete and a
crash leaves at worst an orphan `.data` (the upkeep's leftover sweep removes it a day
later). Downloads stream (`get_object`'s body in
blocks); the runner reads an input file through a temp copy (`local_copy`). Endpoint and
credentials: boto3's own chain (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL_S3`, profiles, IAM roles) and `endpoint_url`.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from producer.serve.storage import FileStore, StoredFile
from producer.serve.storage_location import S3Location, StorageError

_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Storage(FileStore):
    """Files as objects in an S3-compatible bucket (see the module docstring)."""

    def __init__(self, client: Any, where: S3Location, tmp: Path | None = None) -> None:
        super().__init__()
        self.client = client
        self.bucket = where.bucket
        self.prefix = where.prefix
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="qbatch-serve-"))
        self.tmp.mkdir(parents=True, exist_ok=True)

    @classmethod
    def connect(cls, where: S3Location, *, endpoint_url: str | None = None) -> S3Storage:
        """A client from boto3's environment (path-style addressing when `endpoint_url`
        names a non-AWS server), after checking the bucket answers."""
        config = Config(s3={"addressing_style": "path"}) if endpoint_url else None
        try:
            client = boto3.client("s3", endpoint_url=endpoint_url, config=config)
            client.head_bucket(Bucket=where.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"S3 bucket {where.bucket!r}: {exc}") from None
        return cls(client, where)

    def _key(self, file_id: str, kind: str) -> str:
        return f"{self.prefix}files/{file_id}.{kind}"

    # ------------------------------------------------------------ writing

    def _place(self, src: Path, stored: StoredFile) -> None:
        try:
            self.client.upload_file(str(src), self.bucket, self._key(stored.id, "data"))
        finally:
            src.unlink(missing_ok=True)
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(stored.id, "json"),
            Body=stored.document().encode("utf-8"),
            ContentType="application/json",
        )

    # ------------------------------------------------------------ reading

    def _read(self, key: str) -> bytes | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise
        with contextlib.closing(body):
            data: bytes = body.read()
        return data

    def _read_meta(self, file_id: str) -> bytes | None:
        return self._read(self._key(file_id, "json"))

    def _unlink(self, file_id: str, kind: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(file_id, kind))

    @contextlib.contextmanager
    def local_copy(self, stored: StoredFile) -> Iterator[Path]:
        """The file's bytes downloaded to a temp file, removed afterwards."""
        with tempfile.NamedTemporaryFile(prefix="copy-", dir=self.tmp, delete=False) as fh:
            path = Path(fh.name)
        try:
            self.client.download_file(self.bucket, self._key(stored.id, "data"), str(path))
            yield path
        finally:
            path.unlink(missing_ok=True)

    def iter_bytes(self, stored: StoredFile, block: int = 1 << 16) -> Iterator[bytes]:
        """The bytes, streamed. The GET is sent now (a missing object fails here, before
        a response starts); the body is read as the iterator is."""
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(stored.id, "data"))["Body"]

        def chunks() -> Iterator[bytes]:
            with contextlib.closing(body):
                yield from body.iter_chunks(block)

        return chunks()

    def _metadata_docs(self) -> Iterator[tuple[str, bytes]]:
        """One LIST per 1,000 objects and one GET per metadata object."""
        files = f"{self.prefix}files/"
        for key in self._keys(f"{files}file-"):
            raw = self._read(key) if key.endswith(".json") else None
            if raw is not None:
                yield key.removeprefix(files).removesuffix(".json"), raw

    def _file_objects(self) -> Iterator[tuple[str, float]]:
        """One LIST per 1,000 objects; no GETs."""
        files = f"{self.prefix}files/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=files
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"].removeprefix(files), obj["LastModified"].timestamp()

    def _keys(self, prefix: str) -> Iterator[str]:
        """Every key under `prefix`, in ascending order (S3 lists them so)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"]

    # ------------------------------------------------------------ index entries (empty objects)

    def _mark(self, key: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=b"")

    def _unmark(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def _marked(self, key: str) -> bool:
        return self._read(self.prefix + key) is not None

    def _marks(self, folder: str) -> Iterator[str]:
        """One LIST per 1,000 entries; no GETs."""
        where = f"{self.prefix}{folder}/"
        for key in self._keys(where):
            name = key.removeprefix(where)
            if "/" not in name:
                yield name


__all__ = ["S3Storage"]
