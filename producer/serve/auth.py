"""API keys -> tenants for `qbatch serve`, and each tenant's limits. Pure (no sockets).

Two sources, both read once at start:

* `QBATCH_API_KEYS="key1:tenantA,key2:tenantB"`: plain keys in the environment (a
  Kubernetes secret); hashed as they are read, so the process keeps no plain key.
* `--keys-file keys.yaml` (or `.json`): only **sha256 hex digests** of keys, so the file
  leaks nothing usable::

      keys:
        - sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
          tenant: team-a
      tenants:                      # optional per-tenant limits
        team-a: {max_upload_bytes: 104857600, max_concurrent_batches: 4,
                 max_storage_bytes: 10737418240, min_priority: -10, max_priority: 10}

  (`printf %s "$KEY" | sha256sum` gives a digest.)

A presented key is hashed and compared with **every** stored digest with
`hmac.compare_digest` (no early exit), so timing tells nothing about which digest came
close. Keys are never logged, printed or kept in `repr`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from schemas import limits
from schemas.documents import DocumentError, read_document

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Tenant names become Redis key segments (`schemas.keys.RedisKeys.serve_tenant_*`): no
`:`, so one tenant's keys can never be another's."""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class KeysError(ValueError):
    """The keys configuration is unusable (the message never holds a key)."""


def hash_key(key: str) -> str:
    """sha256 hex digest of an API key (what a keys file stores)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Per-tenant limits; None: the server-wide default."""

    max_upload_bytes: int | None = None
    max_concurrent_batches: int | None = None
    max_storage_bytes: int | None = None
    """0: no quota for this tenant, whatever `--max-storage-bytes` says."""
    min_priority: int | None = None
    max_priority: int | None = None
    """The `priority` its batch lines may ask for (clamped into it); without it, 0 only:
    a line's priority orders it among every tenant's lines in the engine, so any range
    is a grant (one tenant's -2147483647 once jumped every other tenant's lines)."""

    @property
    def priority_range(self) -> tuple[int, int]:
        low = self.min_priority if self.min_priority is not None else 0
        high = self.max_priority if self.max_priority is not None else 0
        return (low, max(low, high))


LIMIT_FIELDS = frozenset(f.name for f in fields(TenantLimits))
SIGNED_FIELDS = frozenset({"min_priority", "max_priority"})


@dataclass(frozen=True)
class KeyRing:
    """Digest -> tenant, and tenant -> limits."""

    digests: tuple[tuple[str, str], ...] = ()
    limits: Mapping[str, TenantLimits] = field(default_factory=dict)

    def __repr__(self) -> str:  # never show digests either
        return f"KeyRing({len(self.digests)} keys, tenants={sorted(self.tenants)})"

    @property
    def tenants(self) -> set[str]:
        return {tenant for _digest, tenant in self.digests}

    def tenant_for(self, key: str) -> str | None:
        """The tenant of `key`, or None. Compares against every digest (constant time)."""
        presented = hash_key(key).encode()
        found: str | None = None
        for digest, tenant in self.digests:
            if hmac.compare_digest(presented, digest.encode()) and found is None:
                found = tenant
        return found

    def limits_for(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, TenantLimits())

    def storage_quota(self, tenant: str, default: int | None) -> int | None:
        """The bytes `tenant`'s files may hold (None: no limit): its own
        `max_storage_bytes` (0: none), else the server's `default`."""
        own = self.limits_for(tenant).max_storage_bytes
        return default if own is None else own or None


def _tenant(name: object, where: str) -> str:
    if not isinstance(name, str) or not TENANT_PATTERN.match(name):
        raise KeysError(f"{where}: tenant must be 1-64 characters of [A-Za-z0-9_.-]")
    return name


def parse_env_keys(text: str) -> list[tuple[str, str]]:
    """`key1:tenantA,key2:tenantB` -> [(digest, tenant)]. The error names the entry by
    position, never by its key."""
    out: list[tuple[str, str]] = []
    for index, entry in enumerate(text.split(","), start=1):
        entry = entry.strip()
        if not entry:
            continue
        key, sep, tenant = entry.rpartition(":")
        if not sep or not key:
            raise KeysError(f"QBATCH_API_KEYS entry {index}: expected key:tenant")
        out.append((hash_key(key), _tenant(tenant, f"QBATCH_API_KEYS entry {index}")))
    return out


UNLIMITED_WITH_ZERO = frozenset({"max_storage_bytes"})
"""Limits a tenant may set to 0: none for this tenant, whatever the server's default."""


def _limit(value: object, where: str, *, zero_ok: bool) -> int | None:
    if value is None:
        return None
    least = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise KeysError(
            f"{where}: must be {'an integer >= 0' if zero_ok else 'a positive integer'}"
        )
    return value


def _signed(value: object, where: str) -> int | None:
    if value is None:
        return None
    bound = limits.PRIORITY_BOUND
    if isinstance(value, bool) or not isinstance(value, int) or not -bound < value < bound:
        raise KeysError(f"{where}: must be an integer between -{bound} and {bound}")
    return value


def parse_keys_document(doc: Any, source: str) -> KeyRing:
    """A keys file's parsed content (JSON or YAML) -> a KeyRing."""
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise KeysError(f"{source}: expected a mapping with a 'keys' list")
    unknown = set(doc) - {"keys", "tenants"}
    if unknown:
        raise KeysError(f"{source}: unknown field(s) {sorted(unknown)}")
    digests: list[tuple[str, str]] = []
    for index, item in enumerate(doc["keys"]):
        where = f"{source}: keys[{index}]"
        if not isinstance(item, dict) or set(item) - {"sha256", "tenant"}:
            raise KeysError(f"{where}: expected {{sha256, tenant}}")
        digest = item.get("sha256")
        if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
            raise KeysError(f"{where}: sha256 must be 64 hex digits (a digest, not a key)")
        digests.append((digest.lower(), _tenant(item.get("tenant"), where)))
    limits: dict[str, TenantLimits] = {}
    tenants = doc.get("tenants") or {}
    if not isinstance(tenants, dict):
        raise KeysError(f"{source}: 'tenants' must be a mapping")
    for name, spec in tenants.items():
        where = f"{source}: tenants.{name}"
        _tenant(name, where)
        if not isinstance(spec, dict) or set(spec) - LIMIT_FIELDS:
            raise KeysError(f"{where}: expected a mapping of {', '.join(sorted(LIMIT_FIELDS))}")
        limits[name] = TenantLimits(
            **{
                k: _signed(spec.get(k), f"{where}.{k}")
                if k in SIGNED_FIELDS
                else _limit(spec.get(k), f"{where}.{k}", zero_ok=k in UNLIMITED_WITH_ZERO)
                for k in sorted(LIMIT_FIELDS)
            }
        )
    return KeyRing(tuple(digests), limits)


def read_keys_file(path: Path) -> KeyRing:
    """Load a `.json`, `.yaml` or `.yml` keys file."""
    try:
        doc = read_document(path)
    except DocumentError as exc:
        raise KeysError(str(exc)) from None
    return parse_keys_document(doc, str(path))


def load_keyring(env_keys: str | None, keys_file: Path | None) -> KeyRing:
    """Both sources together; at least one key is required (no open server)."""
    ring = read_keys_file(keys_file) if keys_file is not None else KeyRing()
    digests = list(ring.digests) + parse_env_keys(env_keys or "")
    if not digests:
        raise KeysError("no API keys: set QBATCH_API_KEYS or --keys-file")
    seen: dict[str, str] = {}
    for digest, tenant in digests:
        if seen.get(digest, tenant) != tenant:
            raise KeysError("one key is given to two tenants")
        seen[digest] = tenant
    return KeyRing(tuple(digests), ring.limits)


__all__ = [
    "TENANT_PATTERN",
    "KeyRing",
    "KeysError",
    "TenantLimits",
    "hash_key",
    "load_keyring",
    "parse_env_keys",
    "parse_keys_document",
    "read_keys_file",
]
