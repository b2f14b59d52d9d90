"""The listing index's names and walk order (`producer.serve.file_index`), without a store."""

from __future__ import annotations

import pytest

from producer.serve.file_index import (
    REINDEXED,
    IndexEntry,
    listing_order,
    tenant_dir,
)
from producer.serve.storage import new_stored

A = "file-" + "a" * 32
B = "file-" + "b" * 32
C = "file-" + "c" * 32


def test_an_entry_name_round_trips_and_sorts_by_time() -> None:
    entry = IndexEntry(1_700_000_000, A, "batch")
    assert entry.name == f"001700000000.{A}.batch"
    assert IndexEntry.parse(entry.name) == entry
    assert IndexEntry(9, B, "batch") < IndexEntry(10, A, "batch")


@pytest.mark.parametrize(
    "name",
    [
        REINDEXED,
        "",
        "x",
        f"1700000000.{A}.batch",
        f"001700000000.{A}",
        f"001700000000.{A}.b/x",
        "001700000000.file-XYZ.batch",
        f"001700000000.{A}.batch.tmp",
    ],
)
def test_anything_else_in_an_index_directory_is_not_an_entry(name: str) -> None:
    assert IndexEntry.parse(name) is None


@pytest.mark.parametrize("purpose", ["", "Batch", "a/b", "x" * 33, "batch.out"])
def test_a_purpose_no_name_can_hold_is_refused(purpose: str) -> None:
    with pytest.raises(ValueError):
        new_stored(3, "a", "x.jsonl", purpose, A)


def test_tenant_dirs_are_fixed_width_hex_and_distinct() -> None:
    names = {tenant_dir(t) for t in ("a", "b", "../a", "a/..", "")}
    assert len(names) == 5
    assert all(len(n) == 32 and set(n) <= set("0123456789abcdef") for n in names)


def test_the_walk_orders_filters_and_starts_after_the_cursor() -> None:
    entries = [
        IndexEntry(3, C, "batch"),
        IndexEntry(1, A, "batch"),
        IndexEntry(2, B, "batch_output"),
    ]
    assert [e.file_id for e in listing_order(entries, purpose=None, after=None, order="desc")] == [
        C,
        B,
        A,
    ]
    assert [
        e.file_id for e in listing_order(entries, purpose="batch", after=None, order="asc")
    ] == [
        A,
        C,
    ]
    assert [e.file_id for e in listing_order(entries, purpose=None, after=C, order="desc")] == [
        B,
        A,
    ]
    assert listing_order(entries, purpose=None, after="file-" + "d" * 32, order="desc") == []


def test_a_tombstone_keeps_a_cursors_place_and_is_never_walked() -> None:
    live, gone = IndexEntry(1, A, "batch"), IndexEntry(2, B, "batch").tombstone(50)
    assert gone.name == f"000000000002.{B}.batch.gone000000000050"
    parsed = IndexEntry.parse(gone.name)
    assert parsed is not None and parsed.gone_at == 50 and parsed == IndexEntry(2, B, "batch")
    later = IndexEntry(3, C, "batch")
    walk = listing_order([live, gone, later], purpose=None, after=B, order="asc")
    assert [e.file_id for e in walk] == [C]
    assert [
        e.file_id for e in listing_order([live, gone], purpose=None, after=None, order="asc")
    ] == [A]
