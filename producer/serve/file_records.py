"""The records of `qbatch serve`'s stored files, in Redis (the bytes are objects:
`producer.serve.objects`).

Per file a hash (`RedisKeys.serve_file`: OpenAI's file object, its tenant, the key of
its bytes); per tenant a sorted set of its files by creation time and id, and one per
purpose (`serve_tenant_files`, members `{created_at:012d}.{file_id}` at score 0, so a
listing page after OpenAI's id cursor is one `ZRANGE BYLEX`); a hash of each tenant's
bytes (`serve_storage_bytes`, the quota's measure: one `HGET`); a sorted set of the
files with an expiry policy by time (`serve_files_expiring`, the sweep reads only what is
due). A deleted file leaves a **tombstone** for a day (`serve_file_gone`, a key with a
TTL) so the SDK's clean-up loop, which asks for the page after a file it has just
deleted, still finds its place.

Each change is one Lua script, so a record and its sets never disagree, and each
script first checks this server's lease (`producer.serve.lease`: one server per prefix).
A record changes only by whole writes: `add` replaces one with a new object key, and
`remove` takes one away only if its object key is still the one the caller read
(`Removed.changed` otherwise), so a rewrite racing a delete never loses the new bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from producer.serve.lease import FENCE_LUA, Lease, LeaseLost, lease_lost
from producer.serve.stored_file import FILE_ID, PURPOSE, StoredFile
from schemas.keys import RedisKeys

TOMBSTONE_TTL_S = 86_400
"""How long a deleted file's place in its tenant's listing is remembered."""
PAGE_READ = 100
"""Members a listing reads per round while it skips expired or vanished files."""

_MEMBER = "string.format('%012d.%s', tonumber({created}), {id})"

_ADD = (
    FENCE_LUA
    + f"""
-- KEYS: lease, record, tenant set, purpose set, bytes, expiring, tombstone
-- ARGV: token, tenant, purpose, member, bytes, expires_at|'', quota|'', id, fields...
local old = redis.call('HMGET', KEYS[2], 'tenant', 'purpose', 'bytes', 'created_at', 'object')
local delta = tonumber(ARGV[5])
if old[1] then
  if old[1] ~= ARGV[2] or old[2] ~= ARGV[3] then return {{'conflict', ''}} end
  delta = delta - tonumber(old[3])
end
if ARGV[7] ~= '' and delta > 0 then
  local used = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or '0')
  if used + delta > tonumber(ARGV[7]) then return {{'full', tostring(used)}} end
end
if old[1] then
  local member = {_MEMBER.format(created="old[4]", id="ARGV[8]")}
  redis.call('ZREM', KEYS[3], member)
  redis.call('ZREM', KEYS[4], member)
  redis.call('DEL', KEYS[2])
end
redis.call('ZREM', KEYS[6], ARGV[8])
redis.call('HSET', KEYS[2], unpack(ARGV, 9))
redis.call('ZADD', KEYS[3], 0, ARGV[4])
redis.call('ZADD', KEYS[4], 0, ARGV[4])
if delta ~= 0 and redis.call('HINCRBY', KEYS[5], ARGV[2], delta) == 0 then
  redis.call('HDEL', KEYS[5], ARGV[2])
end
if ARGV[6] ~= '' then redis.call('ZADD', KEYS[6], ARGV[6], ARGV[8]) end
redis.call('DEL', KEYS[7])
return {{'ok', old[5] or ''}}
"""
)

_REMOVE = (
    FENCE_LUA
    + f"""
-- KEYS: lease, record, tenant set, purpose set, bytes, expiring, tombstone
-- ARGV: token, object, tombstone value, tombstone ttl, id
local r = redis.call('HMGET', KEYS[2], 'object', 'tenant', 'bytes', 'created_at')
if not r[1] then
  redis.call('ZREM', KEYS[6], ARGV[5])
  return 'gone'
end
if r[1] ~= ARGV[2] then return 'changed' end
local member = {_MEMBER.format(created="r[4]", id="ARGV[5]")}
redis.call('ZREM', KEYS[3], member)
redis.call('ZREM', KEYS[4], member)
redis.call('ZREM', KEYS[6], ARGV[5])
if redis.call('HINCRBY', KEYS[5], r[2], -tonumber(r[3])) == 0 then
  redis.call('HDEL', KEYS[5], r[2])
end
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[7], ARGV[3], 'EX', ARGV[4])
return 'removed'
"""
)

_MARK = FENCE_LUA + "return redis.call('SET', KEYS[2], ARGV[2])"


class Removed(enum.Enum):
    removed = "removed"
    gone = "gone"
    """No record (deleted meanwhile); its expiry entry, if any, is dropped."""
    changed = "changed"
    """The id was written again since it was read: nothing removed."""


class StorageFull(Exception):
    """Adding the file would take its tenant past its quota."""

    def __init__(self, used: int) -> None:
        super().__init__(f"the tenant's files hold {used} bytes")
        self.used = used


@dataclass
class FileRecords:
    """Stored files' records under one prefix, changed under `lease`."""

    redis: Any
    keys: RedisKeys
    lease: Lease

    def _keys(self, tenant: str, purpose: str, file_id: str) -> list[str]:
        k = self.keys
        return [
            k.serve_lease(),
            k.serve_file(file_id),
            k.serve_tenant_files(tenant),
            k.serve_tenant_files(tenant, purpose),
            k.serve_storage_bytes(),
            k.serve_files_expiring(),
            k.serve_file_gone(file_id),
        ]

    def _eval(self, script: str, keys: list[str], *args: Any) -> Any:
        try:
            return self.redis.eval(script, len(keys), *keys, self.lease.token, *args)
        except Exception as exc:
            if lease_lost(exc):
                raise LeaseLost(str(exc)) from None
            raise

    # ------------------------------------------------------------ changes

    def add(self, stored: StoredFile, quota: int | None = None) -> str | None:
        """Write `stored`'s record (replacing one of the same id, tenant and purpose);
        returns the object key of the record it replaced, if any. StorageFull when
        `quota` is given and the tenant's bytes would pass it (nothing written);
        ValueError when the id is another tenant's or purpose's."""
        fields = [x for kv in stored.to_hash().items() for x in kv]
        status, detail = self._eval(
            _ADD,
            self._keys(stored.tenant, stored.purpose, stored.id),
            stored.tenant,
            stored.purpose,
            stored.member,
            stored.bytes,
            "" if stored.expires_at is None else stored.expires_at,
            "" if quota is None else quota,
            stored.id,
            *fields,
        )
        status, detail = _s(status), _s(detail)
        if status == "full":
            raise StorageFull(int(detail))
        if status == "conflict":
            raise ValueError(f"{stored.id} is stored for another tenant or purpose")
        return detail or None

    def remove(self, stored: StoredFile) -> Removed:
        """Remove `stored`'s record if it still holds `stored.object` (see `Removed`)."""
        return Removed(
            _s(
                self._eval(
                    _REMOVE,
                    self._keys(stored.tenant, stored.purpose, stored.id),
                    stored.object,
                    f"{stored.tenant}\n{stored.member}",
                    TOMBSTONE_TTL_S,
                    stored.id,
                )
            )
        )

    def mark_imported(self) -> None:
        self._eval(_MARK, [self.keys.serve_lease(), self.keys.serve_files_imported()], "1")

    # ------------------------------------------------------------ reads

    def imported(self) -> bool:
        return bool(self.redis.exists(self.keys.serve_files_imported()))

    def get(self, file_id: str) -> StoredFile | None:
        """The record `file_id` names, whoever owns it, expired or not."""
        if not FILE_ID.match(file_id):
            return None
        h = self.redis.hgetall(self.keys.serve_file(file_id))
        stored = StoredFile.from_hash(h) if h else None
        return stored if stored is not None and stored.id == file_id else None

    def objects_of(self, file_ids: list[str]) -> list[str | None]:
        """The object key each file's record names (None: no record), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for file_id in file_ids:
            pipe.hget(self.keys.serve_file(file_id), "object")
        return [None if v is None else _s(v) for v in pipe.execute()]

    def usage(self, tenant: str) -> int:
        return int(self.redis.hget(self.keys.serve_storage_bytes(), tenant) or 0)

    def due(self, now: float, limit: int = 500) -> list[str]:
        """Ids of files whose expiry time has come (oldest first)."""
        ids = self.redis.zrangebyscore(self.keys.serve_files_expiring(), "-inf", now, 0, limit)
        return [_s(x) for x in ids]

    def _place_of(self, file_id: str, tenant: str) -> str | None:
        """The listing member of `tenant`'s file `file_id`, live or deleted within a day."""
        if not FILE_ID.match(file_id):
            return None
        stored = self.get(file_id)
        if stored is not None:
            return stored.member if stored.tenant == tenant else None
        gone = self.redis.get(self.keys.serve_file_gone(file_id))
        owner, _, member = _s(gone or b"").partition("\n")
        return member if gone is not None and owner == tenant else None

    def walk(
        self, tenant: str, *, purpose: str | None, after: str | None, order: str, first: int
    ) -> Iterator[StoredFile]:
        """A tenant's records by creation time (`order`), after the file id `after`
        (nothing when it names no file of the tenant's, live or deleted within a day):
        `first` of them in one round trip, then `PAGE_READ` at a time (expired or
        vanished files are skipped, so a page may need more). A `purpose` no stored file
        can have (`PURPOSE`) lists nothing and never becomes a key."""
        if purpose is not None and not PURPOSE.match(purpose):
            return
        key = self.keys.serve_tenant_files(tenant, purpose)
        desc = order != "asc"
        bound = "+" if desc else "-"
        if after is not None:
            member = self._place_of(after, tenant)
            if member is None:
                return
            bound = f"({member}"
        count = max(1, min(first, PAGE_READ))
        while True:
            end = "-" if desc else "+"
            members = [
                _s(m)
                for m in self.redis.zrange(
                    key, bound, end, desc=desc, bylex=True, offset=0, num=count
                )
            ]
            if not members:
                return
            pipe = self.redis.pipeline(transaction=False)
            for m in members:
                pipe.hgetall(self.keys.serve_file(m.split(".", 1)[1]))
            for h in pipe.execute():
                stored = StoredFile.from_hash(h) if h else None
                if stored is not None and stored.tenant == tenant:
                    yield stored
            bound = f"({members[-1]}"
            count = PAGE_READ


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


__all__ = ["PAGE_READ", "TOMBSTONE_TTL_S", "FileRecords", "Removed", "StorageFull"]
