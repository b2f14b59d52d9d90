"""`/v1/files` of `qbatch serve`: upload, list, retrieve, download (whole or a byte
range) and delete, each a thin call into `producer.serve.storage`, plus the tenants'
storage quota (`StorageQuota`), which the batch route checks too.

Downloads honour one `Range: bytes=a-b` (206 with `Content-Range`; 416 past the end):
an output file of a 50,000-line batch is hundreds of megabytes, and a client whose
download broke resumes it (`curl -C -`) instead of starting over. Any other Range
form gets the whole file (a server may ignore Range).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from producer.serve.auth import KeyRing
from producer.serve.errors import ApiError, not_found
from producer.serve.expiry import form_policy, policy_seconds
from producer.serve.storage import PURPOSE_BATCH, FileStore, StorageFull, UploadTooLarge
from producer.serve.stored_file import StoredFile
from producer.serve.tenant import Tenant
from producer.serve.upload import FormReceiver, check_jsonl

log = logging.getLogger("qbatch.serve")

MULTIPART_SLACK = 64 * 1024
"""Bytes a multipart body may hold beyond the file (boundaries, headers, purpose)."""
_RANGE = re.compile(r"^bytes=(\d{1,18})?-(\d{1,18})?$")
CLEAN = "delete files (DELETE /v1/files/{file_id}) to make room"


@dataclass
class StorageQuota:
    """What a tenant's files may hold (`KeyRing.storage_quota`, else `default`)."""

    storage: FileStore
    keyring: KeyRing
    default: int | None

    def of(self, tenant: str) -> int | None:
        return self.keyring.storage_quota(tenant, self.default)

    async def room(self, tenant: str, size: int | None) -> int | None:
        """Refuse unless `size` more bytes (an upload's) fit, or, for a batch (`size`
        None), unless the tenant is under its quota: a batch's outputs are always
        stored, so a full tenant starts none (those started under it may still take it
        past by their outputs). Returns the bytes still free (None: no quota). An
        upload's final check is atomic with storing it (`FileStore.commit`)."""
        quota = self.of(tenant)
        if quota is None:
            return None
        used = await run_in_threadpool(self.storage.usage, tenant)
        if used + (size or 1) <= quota:
            return quota - used
        raise self.full(tenant, used, quota, size)

    @staticmethod
    def full(tenant: str, used: int, quota: int, size: int | None) -> ApiError:
        what = "a batch" if size is None else f"an upload of {size} bytes"
        log.info("serve: %s's %s refused: %d of %d bytes used", tenant, what, used, quota)
        held = f"Storage limit reached: this key's tenant's files hold {used} of its {quota} bytes"
        if size is None:
            return ApiError(
                403,
                f"{held}, so a batch's output has no room; {CLEAN}",
                code="storage_limit_reached",
            )
        return ApiError(
            413,
            f"{held} and this upload needs {size} more; {CLEAN}",
            code="storage_limit_reached",
            param="file",
        )


def register_files(app: FastAPI, storage: FileStore, quota: StorageQuota, max_upload: int) -> None:
    """Add the `/v1/files` routes."""

    @app.post("/v1/files")
    async def create_file(request: Request, tenant: Tenant) -> dict[str, Any]:
        limit = quota.keyring.limits_for(tenant).max_upload_bytes or max_upload
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit + MULTIPART_SLACK:
            raise _too_large(limit)
        # before receiving: refused at once when it cannot fit; and a body without a
        # length (chunked) is cut where the tenant's room ends, not only at the limit
        least = max(int(length) - MULTIPART_SLACK, 1) if length.isdigit() else 1
        room = await quota.room(tenant, least)
        cap = limit if room is None else min(limit, room)
        receiver = FormReceiver(request.headers.get("content-type", ""), storage, cap)
        try:
            async for chunk in request.stream():
                receiver.feed(chunk)
            receiver.finish()
            upload, purpose = receiver.upload, receiver.fields.get("purpose")
            if purpose != PURPOSE_BATCH:
                raise ApiError(
                    400,
                    f"purpose must be 'batch' (the only purpose qbatch serves), got {purpose!r}",
                    code="invalid_purpose",
                    param="purpose",
                )
            if upload is None:
                raise ApiError(
                    400, "the form has no 'file' part", code="missing_file", param="file"
                )
            expires_after_s = policy_seconds(
                form_policy(receiver.fields, "expires_after"), "expires_after"
            )
            upload.close()
            problem = await run_in_threadpool(check_jsonl, upload.path)
            if problem:
                raise ApiError(
                    400,
                    f"Invalid file format for Batch API: must be JSONL; {problem}",
                    code="invalid_file_format",
                    param="file",
                )
            # off the event loop: with cloud storage this is an upload of up to the limit;
            # the quota is checked again, atomically with the record (other uploads may
            # have landed meanwhile)
            stored = await run_in_threadpool(
                lambda: storage.commit(
                    upload,
                    tenant=tenant,
                    filename=receiver.filename or "",
                    purpose=purpose,
                    expires_after_s=expires_after_s,
                    quota=quota.of(tenant),
                )
            )
        except StorageFull as exc:
            receiver.discard()
            size = receiver.upload.size if receiver.upload else 0
            raise quota.full(tenant, exc.used, quota.of(tenant) or 0, size) from None
        except UploadTooLarge:
            receiver.discard()
            if cap < limit:  # the tenant's storage quota, not the upload limit
                raise ApiError(
                    413,
                    f"Storage limit reached: this upload is larger than the {cap} bytes this "
                    f"key's tenant has left of its quota; {CLEAN}",
                    code="storage_limit_reached",
                    param="file",
                ) from None
            raise _too_large(limit) from None
        except BaseException:
            receiver.discard()
            raise
        return stored.openai()

    @app.get("/v1/files")
    def list_files(
        tenant: Tenant,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
        after: Annotated[str | None, Query(max_length=100)] = None,
    ) -> dict[str, Any]:
        files, more = storage.list(tenant, purpose=purpose, after=after, limit=limit, order=order)
        return page_of([f.openai() for f in files], more)

    def own_file(file_id: str, tenant: str) -> StoredFile:
        stored = storage.get(file_id, tenant)
        if stored is None:
            raise not_found("File", file_id)
        return stored

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str, tenant: Tenant) -> dict[str, Any]:
        return own_file(file_id, tenant).openai()

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, request: Request, tenant: Tenant) -> StreamingResponse:
        stored = own_file(file_id, tenant)
        span = byte_range(request.headers.get("range"), stored.bytes)
        headers = {"accept-ranges": "bytes"}
        try:
            if span is None:
                body = storage.iter_bytes(stored)
                headers["content-length"] = str(stored.bytes)
                status = 200
            else:
                start, end = span
                body = storage.iter_bytes(stored, start, end)
                headers["content-range"] = f"bytes {start}-{end - 1}/{stored.bytes}"
                headers["content-length"] = str(end - start)
                status = 206
        except FileNotFoundError:  # deleted between its record's read and its bytes'
            raise not_found("File", file_id) from None
        return StreamingResponse(
            body, status_code=status, media_type="application/octet-stream", headers=headers
        )

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, tenant: Tenant) -> dict[str, Any]:
        if not storage.delete(file_id, tenant):
            raise not_found("File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The [start, end) a `Range: bytes=...` header asks of a `size`-byte file: None for
    the whole file (no header, or a form served whole: several ranges, a unit other
    than bytes); ApiError 416 for a range that starts past the end."""
    if header is None:
        return None
    m = _RANGE.match(header.strip())
    if m is None or (m[1] is None and m[2] is None):
        return None
    if m[1] is None:  # the last N bytes
        n = int(m[2])
        return (max(0, size - n), size) if n > 0 and size > 0 else _unsatisfiable(size)
    start = int(m[1])
    end = size if m[2] is None else min(size, int(m[2]) + 1)
    if start >= size or start >= end:
        return _unsatisfiable(size)
    return start, end


def _unsatisfiable(size: int) -> tuple[int, int]:
    raise ApiError(
        416,
        f"the range is outside the file's {size} bytes",
        code="range_not_satisfiable",
        headers={"content-range": f"bytes */{size}"},
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"File is too large: the limit for this key's tenant is {limit} bytes",
        code="file_too_large",
        param="file",
    )


def page_of(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list object."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


__all__ = ["MULTIPART_SLACK", "StorageQuota", "byte_range", "page_of", "register_files"]
