"""docs/quality.md's reader-side filters (DuckDB and pyarrow), run as written on an output whose
first manifest comes from before the score, gate and phash columns: it reads them as nulls, so
its rows fail the filters, and the newer manifest's rows that pass come back. The output is
written by hand from the tiny model's scene renderer (tests/unit/jobs/test_score_command.py)."""

from __future__ import annotations

import re

import pyarrow.parquet as pq

from ditfleet.jobs.cli import main
from ditfleet.model.quality import scorer
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO
from tests.unit.jobs.test_score_command import SCENES, _png, _uint8, _write_shard

NEWER_COLUMNS = re.compile(r"^(score_|gate_|phash$)")


def _doc_blocks(language: str) -> list[str]:
    text = (REPO / "docs" / "quality.md").read_text()
    section = text[text.index("## Filtering rows as a reader") : text.index("## Provenance in every image")]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _write_output(out) -> set[str]:
    """out/tiny as the docs name it: shard 0's manifest without the newer columns (as an older
    ditfleet wrote it), shard 1's with sharpness and a gate that the last image failed, and a
    tiny side table. Returns the ids the docs' first filter keeps."""
    store = open_store(str(out))
    _write_shard(store, 0, SCENES)
    table = pq.read_table(out / manifest_key(0))
    pq.write_table(
        table.drop_columns([n for n in table.column_names if NEWER_COLUMNS.match(n)]), out / manifest_key(0)
    )
    writer = ManifestWriter(1, expected_rows=len(SCENES))
    sharpness, kept = scorer("sharpness"), set()
    for i, scene in enumerate(SCENES):
        pixels = _uint8(scene)
        stored = put_image(store, image_key(1, new_attempt_token(0, 0), f"s1-{i}", None, "png"), _png(pixels))
        [sharp] = sharpness.score(pixels[None], [scene.caption])
        row = manifest_row(
            f"s1-{i}",
            1,
            stored,
            prompt=scene.caption,
            scores={"sharpness": sharp},
            gate_passed=i < 2,
            gate_tries=1,
            phash=i,
        )
        writer.add(row)
        if i < 2 and sharp > 0.001:
            kept.add(row.id)
    assert writer.commit(store)
    assert main(["score", str(out), "--scorer", "tiny"]) == 0
    return kept


def test_the_duckdb_and_pyarrow_filters_read_older_manifests_by_name(tmp_path, monkeypatch):
    import duckdb

    kept = _write_output(tmp_path / "out" / "tiny")
    assert kept  # the filter has rows to find
    monkeypatch.chdir(tmp_path)
    [sql] = _doc_blocks("sql")
    with duckdb.connect() as con:
        results = [con.execute(q).fetchall() for q in sql.split(";") if q.strip().strip("-").strip()]
    assert {row[0] for row in results[0]} == kept  # sharp enough and passed; shard 0's nulls fail
    assert {row[0] for row in results[1]} == {"s0-0", "s0-1", "s0-2", "s1-0", "s1-1", "s1-2"}  # tiny 1.0
    # phash i: every pair of shard 1 within 6 bits; shard 0's rows have none (null)
    assert {frozenset(pair[:2]) for pair in results[2]} == {
        frozenset(p) for p in (("s1-0", "s1-1"), ("s1-0", "s1-2"), ("s1-1", "s1-2"))
    }
    [python] = _doc_blocks("python")
    scope: dict = {}
    exec(python, scope)  # noqa: S102 - the documented snippet, as a reader runs it
    assert set(scope["kept"]["id"].to_pylist()) == kept
