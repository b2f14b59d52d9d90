"""Redis key layout of the v1 contract, in one place.

Every key is built here from a validated id (`[A-Za-z0-9_.:-]`), so no request can make a
worker write outside its prefix, and no two (kind, id) pairs give the same key:

* the prefix holds no `:`, so the first `:` ends it; the second segment names the kind
  (`result`, `done`, `job`, `toolcall`, `strikes`, `ack`) and is a fixed word, so kinds cannot meet;
* within `job`, the job's stream and cancel flag are the hash key plus `:done` /
  `:cancel`, which is why a job_id may not end with either (`schemas.limits.
  RESERVED_JOB_SUFFIXES`, refused at the edge): job `vic:done` would otherwise be job
  `vic`'s stream. This keeps the v1 key names, so nothing written before changes.

**Redis Cluster** (`RedisKeys(cluster=True)`, chosen by a `redis+cluster://` URL): every id
is wrapped in a hash tag, `qbatch:result:{<request_id>}`, so the keys a script touches
together share a slot: a result's key and wake-up list (tag: the request_id), a job's hash,
stream, cancel flag and counted set (tag: the job_id), a tenant-day's usage and its counted
set. `qbatch serve`'s batch records, which one transaction updates together, all carry the
fixed tag `{serve}`. Ids never hold `{` or `}`, so the tag is exactly the id and the layout
stays injective (the same proof, ids wrapped).

tests/unit/test_keys.py proves the layout injective over generated ids built to collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class JobField(StrEnum):
    """Fields of the `{prefix}:job:{job_id}` hash."""

    total = "total"
    succeeded = "succeeded"
    failed = "failed"
    expired = "expired"
    cancelled = "cancelled"
    created_at = "created_at"
    updated_at = "updated_at"
    submitted = "submitted"
    status = "status"
    # written and read by the producer only (bulk jobs)
    input_path = "input_path"
    input_sha256 = "input_sha256"
    attempt = "attempt"
    retry_line = "retry_line"


DUPLICATE_FIELD_PREFIX = "dup:"
"""Job-hash field `dup:{request_id}`: this job counted a request whose id already held
another job's result (once, however often the record comes back)."""


class JobStatus(StrEnum):
    submitting = "submitting"
    running = "running"
    cancelling = "cancelling"
    completed = "completed"
    completed_with_errors = "completed_with_errors"
    cancelled = "cancelled"


class StreamField(StrEnum):
    """Fields of an entry of the `{prefix}:job:{job_id}:done` stream."""

    request_id = "request_id"
    custom_id = "custom_id"
    status = "status"
    result = "result"
    """Present only when the result cannot live at its result key (a request_id already
    answered for another job): the result envelope JSON itself."""


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = "qbatch"
    cluster: bool = False
    """Redis Cluster layout: ids wrapped in hash tags (see the module docstring)."""

    def _tag(self, slot_id: str) -> str:
        return f"{{{slot_id}}}" if self.cluster else slot_id

    def ack(self, key: str = "") -> str:
        """A short-lived key in `key`'s slot, set after a batch of writes so that `WAIT`
        after it covers them even when they were all no-ops (see `schemas.replica_ack`)."""
        if not self.cluster:
            return f"{self.prefix}:ack"
        start = key.find("{")
        end = key.find("}", start + 1) if start >= 0 else -1
        # Redis hashes the first non-empty {...} of a key, or the whole key without one
        tag = key[start + 1 : end] if start >= 0 and end > start + 1 else key
        return f"{self.prefix}:ack:{{{tag}}}"

    def result(self, request_id: str) -> str:
        return f"{self.prefix}:result:{self._tag(request_id)}"

    def done(self, request_id: str) -> str:
        return f"{self.prefix}:done:{self._tag(request_id)}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{self._tag(job_id)}"

    def job_stream(self, job_id: str) -> str:
        return f"{self.job(job_id)}:done"

    def job_cancel(self, job_id: str) -> str:
        return f"{self.job(job_id)}:cancel"

    def job_lines(self, job_id: str) -> str:
        """String: a bitmap of the job's request line numbers (bit n, most significant
        first as SETBIT counts, set when physical line n is a request). `qbatch serve`
        writes it before publishing, so an expired batch's unanswered lines can be
        answered even after its input file was deleted."""
        return f"{self.job(job_id)}:lines"

    def job_counted(self, job_id: str) -> str:
        """Set (cluster layout only): the request ids this job's counters include. On a
        cluster a result and its job live in different slots, so the result is written
        first and counted in its job by a second script; this set makes that second step
        idempotent (a crash between the two, or two workers racing, counts once)."""
        return f"{self.job(job_id)}:counted"

    def tool_call(self, request_id: str, turn: int, fingerprint: str) -> str:
        """String: the recorded outcome (`schemas.tool_loop.CallRecord` JSON) of one call
        of a tool loop's turn; `fingerprint` is a hex digest of the call (id, name,
        arguments), so only the same call reuses it."""
        return f"{self.prefix}:toolcall:{self._tag(request_id)}:{turn}:{fingerprint}"

    def serve_batch(self, batch_id: str) -> str:
        """Hash: one OpenAI Batch object of `qbatch serve` (its bulk job is `job(batch_id)`).
        Kind `serve` is a fixed word, so these keys meet no other kind's."""
        return f"{self._serve()}:batch:{batch_id}"

    def serve_tenant_batches(self, tenant: str) -> str:
        """Sorted set: a tenant's batch ids by creation time (ms), for `GET /v1/batches`.
        Tenant names hold no `:` (`producer.serve.auth`), so two tenants never share it."""
        return f"{self._serve()}:tenant:{tenant}:batches"

    def serve_tenant_active(self, tenant: str) -> str:
        """Set: a tenant's batches not in a final state (its concurrent-batch limit)."""
        return f"{self._serve()}:tenant:{tenant}:active"

    def serve_active(self) -> str:
        """Set: every batch not in a final state; the server's runner resumes these."""
        return f"{self._serve()}:active"

    def _serve(self) -> str:
        """`qbatch serve`'s batch records: one transaction (WATCH/MULTI) updates a batch
        and its tenant's sets together, so on a cluster they share the tag `{serve}`."""
        return f"{self.prefix}:{{serve}}" if self.cluster else f"{self.prefix}:serve"

    def serve_file(self, file_id: str) -> str:
        """Hash: one stored file of `qbatch serve` (OpenAI's file object, its tenant and
        the key of the object holding its bytes: `producer.serve.file_records`)."""
        return f"{self._serve()}:file:{file_id}"

    def serve_file_gone(self, file_id: str) -> str:
        """String, a day's TTL: a deleted file's tenant and listing member, so a listing
        cursor naming it still finds its place."""
        return f"{self._serve()}:file-gone:{file_id}"

    def serve_tenant_files(self, tenant: str, purpose: str | None = None) -> str:
        """Sorted set (score 0, members `{created_at:012d}.{file_id}`, so by creation time
        and then id): a tenant's files, or those of one `purpose`, for `GET /v1/files`."""
        base = f"{self._serve()}:tenant:{tenant}:files"
        return base if purpose is None else f"{base}:{purpose}"

    def serve_storage_bytes(self) -> str:
        """Hash tenant -> the bytes its stored files hold (its storage quota's measure)."""
        return f"{self._serve()}:storage-bytes"

    def serve_files_expiring(self) -> str:
        """Sorted set file_id -> expires_at: files with an `expires_after` policy."""
        return f"{self._serve()}:files-expiring"

    def serve_files_imported(self) -> str:
        """String: the storage's metadata documents of a release before 2026-12-07 are
        imported (`producer.serve.legacy_import`)."""
        return f"{self._serve()}:files-imported"

    def serve_lease(self) -> str:
        """String, with a TTL: the token of the one `qbatch serve` working on this prefix
        (`producer.serve.lease`); every state change checks it."""
        return f"{self._serve()}:lease"

    def serve_lease_epoch(self) -> str:
        """Counter: how many leases were taken on this prefix (a token's first part)."""
        return f"{self._serve()}:lease-epoch"

    def serve_runner_current(self) -> str:
        """String: the batch `qbatch serve`'s runner is stepping now (a server that starts
        and finds it set died under that step: `producer.serve.batch_strikes`)."""
        return f"{self._serve()}:runner:current"

    def serve_runner_strikes(self) -> str:
        """Hash batch_id -> how often a server died while stepping that batch."""
        return f"{self._serve()}:runner:strikes"

    def serve_usage(self, tenant: str, day: str) -> str:
        """Hash `{kind}:{model}` -> count: a tenant's usage on UTC day `day` (YYYY-MM-DD),
        kinds `producer.usage.KINDS`. The day holds no `:`, so it is the last segment and
        the tenant is the rest: no two (tenant, day) pairs share a key."""
        return f"{self.prefix}:serve:usage:{self._tag(f'{tenant}:{day}')}"

    def serve_usage_scan(self) -> str:
        """SCAN pattern of every `serve_usage` key (see `serve_usage_of`)."""
        return f"{self.prefix}:serve:usage:*"

    def serve_usage_of(self, key: str) -> tuple[str, str] | None:
        """(tenant, day) of a `serve_usage` key, None for any other key."""
        head = f"{self.prefix}:serve:usage:"
        if not key.startswith(head):
            return None
        rest = key[len(head) :]
        if self.cluster:
            if not (rest.startswith("{") and rest.endswith("}")):
                return None
            rest = rest[1:-1]
        tenant, _, day = rest.rpartition(":")
        return (tenant, day) if tenant and day else None

    def serve_usage_counted(self, tenant: str, day: str) -> str:
        """Set: the request ids already added to `serve_usage(tenant, day)` (each result
        counts once, however often it is seen)."""
        return f"{self.prefix}:serve:counted:{self._tag(f'{tenant}:{day}')}"

    def serve_session(self, digest: str) -> str:
        """String: the tenant of a `qbatch serve` page session, by the SHA-256 (hex) of its
        cookie's token (the cookie never holds an API key)."""
        return f"{self.prefix}:serve:session:{self._tag(digest)}"

    def loop_key(self) -> str:
        """String: the key continuations are signed with, when `QBATCH_LOOP_KEY` is unset
        (`schemas.loop_auth`)."""
        return f"{self.prefix}:loopkey"

    def strikes(self, group: str) -> str:
        """Hash `{topic}/{partition}/{offset}/{crc32}` -> how often a worker of consumer group
        `group` stopped on a fault while handling that record (poison-pill guard)."""
        return f"{self.prefix}:strikes:{group}"


DONE_TOKEN = "1"
"""What the worker pushes onto `{prefix}:done:{request_id}`."""
