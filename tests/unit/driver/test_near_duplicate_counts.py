"""Near duplicates over an output's committed manifests (driver.output.near_duplicate_counts): each
committed image once (a redo's superseded generation is not read), in shard order, capped at a
limit that the line then states; outputs older than the phash column count nothing. Synthetic
manifests with the real schema, in a local store."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow.parquet as pq

from ditfleet.driver.output.near_duplicate_counts import (
    near_duplicate_line,
    near_duplicates_of,
    output_near_duplicates,
)
from ditfleet.driver.output.status import output_status
from ditfleet.testing.outputs import manifest_row
from ditfleet.workers.output.layout import manifest_key
from ditfleet.workers.output.manifest import manifest_bytes, read_manifests
from ditfleet.workers.storage import ObjectStore, open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet

BASE = 0x0123_4567_89AB_CDEF
FAR = [0x7F00_0000_0000_00FF, 0x00FF_FF00_0F0F_F000, 0x5555_0000_AAAA_0000]  # > 6 bits from all


def _rows(shard: int, images: list[tuple[str, int | None]]) -> bytes:
    """A manifest of (prompt, phash) images; a None phash is a failed image."""
    rows = [
        manifest_row(f"s{shard}-{i}", shard, ("u", "ab" * 32, 1), prompt=prompt, phash=phash)
        if phash is not None
        else manifest_row(f"s{shard}-{i}", shard, None, prompt=prompt, error="boom")
        for i, (prompt, phash) in enumerate(images)
    ]
    return manifest_bytes(rows)


def _output(root: Path) -> ObjectStore:
    store = open_store(str(root))
    store.put(manifest_key(0), _rows(0, [("cat", BASE), ("cat", BASE ^ 0b11), ("dog", None)]))
    store.put(manifest_key(1), _rows(1, [("dog", BASE ^ (1 << 40)), ("cow", FAR[0])]))
    # Shard 2's first generation holds a near copy of BASE; its redo, which supersedes it, does not.
    store.put(manifest_key(2), _rows(2, [("eel", BASE ^ 1)]))
    store.put(manifest_key(2, 1), _rows(2, [("eel", FAR[1]), ("fox", FAR[2])]))
    return store


def test_each_committed_image_counts_once_and_a_superseded_generation_not_at_all(tmp_path: Path):
    store = _output(tmp_path / "out")
    counts = output_near_duplicates(store)
    # cat's second seed repeats cat's first; dog's image repeats cat's; the redone shard adds two
    # distinct images; the failed image has no hash.
    assert counts == {"images": 6, "same_prompt": 1, "across_prompts": 1, "limited": False}
    # `ditfleet report` counts from its own table of the same current manifests: the same counts.
    assert near_duplicates_of(read_manifests(store)) == counts
    status = output_status(store)
    assert status.to_dict()["near_duplicates"] == counts
    assert (
        "near duplicates: 1 of 6 images repeat another seed of their prompt, 1 another prompt's image"
        in status.format_text()
    )
    assert output_near_duplicates(store, shards=[1, 2]) == {
        "images": 4,
        "same_prompt": 0,
        "across_prompts": 0,
        "limited": False,
    }


def test_the_count_stops_at_its_limit_and_says_so(tmp_path: Path):
    store = _output(tmp_path / "out")
    counts = output_near_duplicates(store, limit=2)
    assert counts == {"images": 2, "same_prompt": 1, "across_prompts": 0, "limited": True}
    assert "counted over the first 2 images in shard order, not all" in near_duplicate_line(counts)


def test_manifests_older_than_the_phash_column_count_nothing(tmp_path: Path):
    store = open_store(str(tmp_path / "old"))
    table = read_parquet(_rows(0, [("cat", BASE), ("cat", BASE)]))
    # A manifest written before phash existed lacks it and every column added after it.
    table = table.drop_columns(table.schema.names[table.schema.get_field_index("phash") :])
    sink = io.BytesIO()
    pq.write_table(table, sink)
    store.put(manifest_key(0), sink.getvalue())
    assert output_near_duplicates(store) == {}
    assert near_duplicates_of(read_manifests(store)) == {}
    assert "near duplicates" not in output_status(store).format_text()
