"""`qbatch serve` API keys: env and file sources, hashed storage, tenant limits. Pure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producer.serve.auth import (
    KeysError,
    hash_key,
    load_keyring,
    parse_env_keys,
    parse_keys_document,
    read_keys_file,
)


def test_env_keys_are_hashed_and_name_their_tenant() -> None:
    ring = load_keyring("sk-one:team-a, sk-two:team-b", None)
    assert ring.tenant_for("sk-one") == "team-a" and ring.tenant_for("sk-two") == "team-b"
    assert ring.tenant_for("sk-three") is None and ring.tenant_for("") is None
    assert all("sk-one" not in digest for digest, _ in ring.digests)
    assert "sk-one" not in repr(ring) and hash_key("sk-one") not in repr(ring)


def test_a_key_may_hold_colons() -> None:
    assert parse_env_keys("a:b:c:tenant") == [(hash_key("a:b:c"), "tenant")]


@pytest.mark.parametrize("text", ["nokey", ":tenant", "key:", "key:bad:tenant!", "key:has space"])
def test_bad_env_entries_are_refused_without_showing_the_key(text: str) -> None:
    with pytest.raises(KeysError) as err:
        parse_env_keys(text)
    assert "entry 1" in str(err.value)
    secret = text.split(":")[0]
    assert not secret or secret not in str(err.value)


def test_keys_file_holds_digests_and_limits(tmp_path: Path) -> None:
    doc = {
        "keys": [{"sha256": hash_key("sk-file").upper(), "tenant": "team-f"}],
        "tenants": {"team-f": {"max_upload_bytes": 1024, "max_concurrent_batches": 2}},
    }
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(doc))
    ring = load_keyring("sk-env:team-e", path)
    assert ring.tenant_for("sk-file") == "team-f" and ring.tenant_for("sk-env") == "team-e"
    limits = ring.limits_for("team-f")
    assert (limits.max_upload_bytes, limits.max_concurrent_batches) == (1024, 2)
    assert ring.limits_for("team-e").max_upload_bytes is None


def test_yaml_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - sha256: {hash_key('k')}\n    tenant: y\n")
    assert read_keys_file(path).tenant_for("k") == "y"


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"keys": [{"sha256": "sk-plain-key", "tenant": "a"}]},  # a key, not a digest
        {"keys": [{"sha256": "0" * 64, "tenant": "a:b"}]},
        {"keys": [{"sha256": "0" * 64, "tenant": "a", "extra": 1}]},
        {"keys": [], "tenants": {"a": {"max_upload_bytes": 0}}},
        {"keys": [], "tenants": {"a": {"max_upload_bytes": True}}},
        {"keys": [], "other": 1},
    ],
)
def test_bad_keys_documents(doc: object) -> None:
    with pytest.raises(KeysError):
        parse_keys_document(doc, "keys.json")


def test_no_keys_or_one_key_for_two_tenants_is_refused() -> None:
    with pytest.raises(KeysError, match="no API keys"):
        load_keyring("", None)
    with pytest.raises(KeysError, match="two tenants"):
        load_keyring("k:a,k:b", None)
