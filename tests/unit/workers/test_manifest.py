"""The manifest: one schema, create-only commit, and a union every reader reads as one table."""

from __future__ import annotations

import datetime
import json
import math

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from ditfleet.testing.outputs import manifest_row
from ditfleet.workers.output.manifest import (
    MANIFEST_SCHEMA,
    ManifestRow,
    ManifestWriter,
    committed_shards,
    manifest_table,
    passthrough_json,
    read_manifests,
)
from ditfleet.workers.storage import ObjectStore, open_store

# The columns, types and nullability that readers of the manifest rely on (the manifest row of
# workers/output/manifest.py, described in docs/reliability.md), written out by hand so that a
# change to the row type shows up here as a schema change.
EXPECTED_COLUMNS = [
    ("id", pa.string(), False),
    ("k", pa.int32(), False),
    ("prompt", pa.string(), False),
    ("negative_prompt", pa.string(), True),
    ("seed", pa.int64(), False),
    ("width", pa.int32(), False),
    ("height", pa.int32(), False),
    ("bucket", pa.string(), False),
    ("steps", pa.int32(), False),
    ("true_cfg_scale", pa.float64(), False),
    ("model_id", pa.string(), False),
    ("model_revision", pa.string(), True),
    ("status", pa.string(), False),
    ("error", pa.string(), True),
    ("uri", pa.string(), True),
    ("sha256", pa.string(), True),
    ("bytes", pa.int64(), True),
    ("format", pa.string(), False),
    ("generate_s", pa.float64(), True),
    ("encode_s", pa.float64(), True),
    ("upload_s", pa.float64(), True),
    ("worker", pa.string(), False),
    ("attempt", pa.int32(), False),
    ("shard", pa.int32(), False),
    ("compile_fallback", pa.bool_(), False),
    ("recompiles", pa.int32(), False),
    ("extra", pa.string(), True),
    ("step_cache", pa.string(), True),
    ("dit_blocks_computed", pa.int64(), True),
    ("dit_blocks_reused", pa.int64(), True),
    ("batch_size", pa.int32(), True),
    ("score_sharpness", pa.float64(), True),
    ("score_tiny", pa.float64(), True),
    ("score_vqa", pa.float64(), True),
    ("score_clip", pa.float64(), True),
    ("gate_passed", pa.bool_(), True),
    ("gate_tries", pa.int32(), True),
    ("gate_kept", pa.int32(), True),
    ("gate_scores", pa.string(), True),
    ("gate_seeds", pa.string(), True),
    ("phash", pa.int64(), True),
    ("model_license", pa.string(), True),
    ("source_uris", pa.list_(pa.field("element", pa.string())), True),
    ("source_sha256", pa.list_(pa.field("element", pa.string())), True),
]
DESIGN_COLUMNS = {name for name, _, _ in EXPECTED_COLUMNS}


def make_row(shard: int, i: int, ok: bool = True, **overrides) -> ManifestRow:
    stored = (f"s3://b/out/images/{shard:05d}/row-{i}.png", "ab" * 32, 1234) if ok else None
    fields = dict(
        prompt=f"a photo of thing {i}",
        negative_prompt=None if i % 2 else " ",
        seed=1_000_000_007 * i,
        height=48,
        bucket="64x48",
        true_cfg_scale=4.0,
        model_id="tiny",
        error=None if ok else "encode failed: ImageEncodeError: non-finite values",
        generate_s=0.5,
        encode_s=0.01 if ok else None,
        upload_s=0.02 if ok else None,
        worker="node-1/actor-0",
    )
    return manifest_row(f"row-{i}", shard, stored, **{**fields, **overrides})


@pytest.fixture
def store(tmp_path) -> ObjectStore:
    """A local store; tests/integration/test_manifest_s3.py runs the store tests on S3."""
    return open_store(str(tmp_path / "out"))


def test_schema_has_every_design_column_with_its_type() -> None:
    assert [(f.name, f.type, f.nullable) for f in MANIFEST_SCHEMA] == EXPECTED_COLUMNS
    assert MANIFEST_SCHEMA.metadata == {b"ditfleet.manifest_version": b"1"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"status": "done"}, "status 'done' is not one of"),
        ({"sha256": None}, "an ok row needs uri, sha256 and bytes"),
        ({"status": "failed", "error": None}, "a failed row needs an error message"),
        ({"seed": "7"}, "seed must be an int"),
        ({"width": True}, "width must be an int"),
        ({"prompt": None}, "prompt may not be null"),
        ({"true_cfg_scale": "4"}, "true_cfg_scale must be a number"),
    ],
)
def test_rows_are_checked(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"manifest row id='row-3' k=0: .*{message}"):
        make_row(0, 3, **overrides)


_A, _B = "a" * 64, "b" * 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"source_uris": ["s3://in/a.png"]}, "both null .* or both set"),
        ({"source_uris": ["s3://in/a.png"], "source_sha256": [_A, _B]}, "1 source_uris but 2 source_sha256"),
        (
            {"source_uris": ["s3://in/a.png"], "source_sha256": [None]},
            "an ok row needs every source's sha256",
        ),
        ({"source_uris": [None], "source_sha256": [_A]}, "source_uris may not hold a null"),
        ({"source_uris": "s3://in/a.png", "source_sha256": [_A]}, "source_uris must be a list of str"),
        ({"source_uris": [b"a"], "source_sha256": [_A]}, "source_uris must be a list of str"),
    ],
)
def test_an_edit_rows_sources_are_checked(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"manifest row id='row-3' k=0: .*{message}"):
        make_row(0, 3, **overrides)


def test_an_edit_jobs_sources_read_back_and_join_to_the_source_table(tmp_path) -> None:
    """Edit rows name their sources (lists, in column order); a failed row may have an unread
    source (null sha256); text rows hold nulls. Every reader takes the lists, and DuckDB joins
    the images back to a table of the sources by unnesting both lists together."""
    import duckdb
    from datasets import load_dataset

    store = open_store(str(tmp_path / "out"))
    rows = [
        make_row(0, 0, source_uris=["s3://in/cat.png"], source_sha256=[_A]),
        make_row(0, 1, source_uris=("s3://in/cat.png", "in.parquet#row=1&image=1"), source_sha256=(_A, _B)),
        make_row(
            0, 2, ok=False, error="source 1: s3://in/gone.png: not found",
            source_uris=["s3://in/cat.png", "s3://in/gone.png"], source_sha256=[_A, None],
        ),
        make_row(0, 3),  # a text row: no sources
    ]  # fmt: skip
    writer = ManifestWriter(0, expected_rows=len(rows))
    for row in rows:
        writer.add(row)
    assert writer.commit(store)
    table = read_manifests(store)
    assert table.schema.equals(MANIFEST_SCHEMA, check_metadata=True)
    assert table.column("source_uris").to_pylist()[1] == ["s3://in/cat.png", "in.parquet#row=1&image=1"]
    assert table.column("source_sha256").to_pylist() == [[_A], [_A, _B], [_A, None], None]

    files = [str(p) for p in (tmp_path / "out" / "manifests").glob("shard-*.parquet")]
    con = duckdb.connect()
    con.execute("CREATE TABLE sources AS SELECT * FROM (VALUES ('s3://in/cat.png', 'a cat')) t(uri, caption)")
    # The query docs/reliability.md shows: unnest in one SELECT zips the lists, position by position.
    joined = con.execute(
        "WITH s AS (SELECT id, unnest(source_uris) AS uri, unnest(source_sha256) AS sha256, "
        "generate_subscripts(source_uris, 1) AS i FROM read_parquet(?)) "
        "SELECT s.id, s.i, s.uri, left(s.sha256, 1), src.caption FROM s LEFT JOIN sources src USING (uri) "
        "ORDER BY s.id, s.i",
        [files],
    ).fetchall()
    con.close()
    assert joined == [
        ("row-0", 1, "s3://in/cat.png", "a", "a cat"),
        ("row-1", 1, "s3://in/cat.png", "a", "a cat"),
        ("row-1", 2, "in.parquet#row=1&image=1", "b", None),
        ("row-2", 1, "s3://in/cat.png", "a", "a cat"),
        ("row-2", 2, "s3://in/gone.png", None, None),
    ]
    hf = load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert hf[1]["source_uris"] == ["s3://in/cat.png", "in.parquet#row=1&image=1"]
    assert hf[3]["source_sha256"] is None


def test_passthrough_json_keeps_order_and_types() -> None:
    text = passthrough_json(
        {
            "z": 1,
            "a": [1.5, None],
            "when": datetime.date(2024, 5, 1),
            "nan": math.nan,
            "blob": b"\x00\x01",
            "ü": "ö",
        }
    )
    assert text == '{"z":1,"a":[1.5,null],"when":"2024-05-01","nan":"NaN","blob":"AAE=","ü":"ö"}'
    assert passthrough_json({}) is None
    assert make_row(0, 1, extra={"source": "laion"}).extra == '{"source":"laion"}'


def test_commit_is_create_only_first_writer_wins(store: ObjectStore) -> None:
    first = ManifestWriter(shard=4, expected_rows=3)
    for i in range(3):
        first.add(make_row(4, i, worker="first"))
    second = ManifestWriter(shard=4)
    for i in range(3):
        second.add(make_row(4, i, worker="second", attempt=1))
    assert first.commit(store) is True
    assert second.commit(store) is False  # the later attempt sees the commit and discards its work
    assert first.commit(store) is True  # committing the same bytes again is idempotent
    table = read_manifests(store)
    assert table.column("worker").to_pylist() == ["first"] * 3
    assert committed_shards(store) == {4}


def test_writer_refuses_incomplete_or_inconsistent_shards() -> None:
    writer = ManifestWriter(shard=1, expected_rows=2)
    writer.add(make_row(1, 0))
    with pytest.raises(ValueError, match="added twice"):
        writer.add(make_row(1, 0))
    with pytest.raises(ValueError, match="belongs to shard 2, not 1"):
        writer.add(make_row(2, 5))
    with pytest.raises(ValueError, match="1 manifest rows, expected 2"):
        writer.commit(open_store("/nonexistent-never-written"))
    with pytest.raises(ValueError, match="without rows"):
        ManifestWriter(shard=3).commit(open_store("/nonexistent-never-written"))


def _write_three_shards(store: ObjectStore) -> None:
    # Shard 0: all ok, no pass-through (every nullable column all-null); shard 1: failures;
    # shard 2: pass-through values of different types per row.
    extras = [{"source": "web", "score": 0.5}, {"source": "book", "score": 7, "tags": ["a", "b"]}, {}]
    for shard, rows in enumerate(
        [
            [make_row(0, i) for i in range(4)],
            [make_row(1, i, ok=i != 2) for i in range(4)],
            [make_row(2, i, extra=extras[i % 3]) for i in range(4)],
        ]
    ):
        writer = ManifestWriter(shard, expected_rows=len(rows))
        for row in rows:
            writer.add(row)
        assert writer.commit(store)
    store.put("manifests/.unrelated", b"not a manifest")  # ignored by readers of the layout


def test_union_reads_as_one_table_everywhere(tmp_path) -> None:
    import duckdb
    import pandas as pd

    store = open_store(str(tmp_path / "out"))
    _write_three_shards(store)
    files = sorted(str(p) for p in (tmp_path / "out" / "manifests").glob("shard-*.parquet"))

    table = read_manifests(store)
    assert table.schema.equals(MANIFEST_SCHEMA, check_metadata=True) and table.num_rows == 12
    assert table.column("shard").to_pylist() == [0] * 4 + [1] * 4 + [2] * 4

    dataset = pads.dataset(files, format="parquet")
    assert dataset.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    assert dataset.to_table().num_rows == 12

    frame = pd.read_parquet(files)
    assert len(frame) == 12 and (frame["status"] == "failed").sum() == 1
    assert frame["seed"].dtype == "int64"

    con = duckdb.connect()
    count, failed, web = con.execute(
        "SELECT count(*), count(*) FILTER (status = 'failed'), "
        "count(*) FILTER (json_extract_string(extra, '$.source') = 'web') "
        f"FROM read_parquet({files!r})"
    ).fetchone()
    con.close()
    assert (count, failed, web) == (12, 1, 2)

    from datasets import load_dataset

    hf = load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert hf.num_rows == 12 and set(hf.column_names) == DESIGN_COLUMNS
    assert hf.features["seed"].dtype == "int64"
    assert json.loads(hf[8]["extra"]) == {"source": "web", "score": 0.5}


_SOURCES = ["source_uris", "source_sha256"]


def test_a_manifest_written_before_the_step_cache_columns_still_reads(tmp_path) -> None:
    """Older outputs lack the (nullable, trailing) step-cache columns: read as nulls, not refused."""
    from ditfleet.workers.output.manifest import with_later_columns

    scores = [
        "score_sharpness",
        "score_tiny",
        "score_vqa",
        "score_clip",
        "gate_passed",
        "gate_tries",
        "gate_kept",
        "gate_scores",
        "gate_seeds",
        "phash",
        "model_license",
        *_SOURCES,
    ]
    old = MANIFEST_SCHEMA.empty_table().drop_columns(
        ["step_cache", "dit_blocks_computed", "dit_blocks_reused", "batch_size", *scores]
    )
    upgraded = with_later_columns(old)
    assert upgraded.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    # ... and those before the per-image batch size (workers.batch_fit), and before the scores.
    no_batch = with_later_columns(MANIFEST_SCHEMA.empty_table().drop_columns(["batch_size", *scores]))
    assert no_batch.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    no_scores = with_later_columns(MANIFEST_SCHEMA.empty_table().drop_columns(scores))
    assert no_scores.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    # ... and those of the scores and gate, before the perceptual hash.
    no_phash = with_later_columns(
        MANIFEST_SCHEMA.empty_table().drop_columns(["phash", "model_license", *_SOURCES])
    )
    assert no_phash.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    # ... and those before the model's licence (workers.weights.licence).
    no_licence = with_later_columns(MANIFEST_SCHEMA.empty_table().drop_columns(["model_license", *_SOURCES]))
    assert no_licence.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    # ... and those before edit jobs' source columns: a text job's rows, nulls there.
    no_sources = with_later_columns(MANIFEST_SCHEMA.empty_table().drop_columns(_SOURCES))
    assert no_sources.schema.equals(MANIFEST_SCHEMA, check_metadata=False)
    # Anything else that differs is still refused by the readers.
    other = MANIFEST_SCHEMA.empty_table().drop_columns(["shard"])
    assert not with_later_columns(other).schema.equals(MANIFEST_SCHEMA, check_metadata=False)


def test_a_phash_with_its_top_bit_set_is_stored_as_its_int64_bits_and_only_for_stored_images():
    from ditfleet.workers.generate import GeneratedImage
    from ditfleet.workers.quality_gate import ScoredImage

    image = GeneratedImage(request=None, pixels=None, error=None, generate_s=0.0)  # type: ignore[arg-type]
    top = ScoredImage(image, phash=(1 << 63) | 5)
    columns = top.manifest_columns(stored_ok=True)
    assert columns["phash"] == -(1 << 63) + 5
    table = manifest_table([make_row(0, 0, **columns)])
    assert (table.column("phash")[0].as_py() & (2**64 - 1)) == (1 << 63) | 5
    assert ScoredImage(image, phash=7).manifest_columns(stored_ok=True)["phash"] == 7
    assert "phash" not in top.manifest_columns(stored_ok=False)  # the row's column stays null
