"""docs/quality.md's queries of `extra` (the input's pass-through columns as one JSON string column)
run as written, with DuckDB, pyarrow and Hugging Face datasets, on an output whose manifests hold
the example job's pass-through columns (`shape`, `color`), one row without any."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import duckdb
import pytest

from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter, passthrough_json
from ditfleet.workers.storage import open_store
from tests.support.paths import REPO

ROWS = [("r0", {"shape": "triangle", "color": "yellow"}), ("r1", {"shape": "circle", "color": "red"}),
        ("r2", {"shape": "square", "color": "yellow"}), ("r3", {})]  # fmt: skip


def _blocks(language: str) -> list[str]:
    text = (REPO / "docs" / "quality.md").read_text()
    section = text[text.index("## Your own columns: `extra`") : text.index("## Filtering rows as a reader")]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def _write_output(root) -> None:
    store = open_store(str(root / "out" / "tiny"))
    writer = ManifestWriter(0, expected_rows=len(ROWS))
    for row_id, columns in ROWS:
        stored = put_image(store, image_key(0, new_attempt_token(0, 0), row_id, None, "png"), b"png")
        writer.add(manifest_row(row_id, 0, stored, extra=passthrough_json(columns)))
    assert writer.commit(store)


def test_the_extra_queries_in_duckdb_and_pyarrow_run_as_written(tmp_path, monkeypatch):
    _write_output(tmp_path)
    monkeypatch.chdir(tmp_path)
    [sql] = _blocks("sql")
    rows = duckdb.sql(sql).fetchall()
    assert sorted((r[0], r[2], r[3]) for r in rows) == [
        ("r0", "triangle", "yellow"),
        ("r2", "square", "yellow"),
    ]
    pyarrow_block = _blocks("python")[0]
    scope: dict = {}
    exec(compile(pyarrow_block, "docs/quality.md (pyarrow)", "exec"), scope)  # noqa: S102 - the doc's own code
    table = scope["table"].sort_by("id")
    assert table.column_names == ["id", "uri", "shape"]
    assert table.column("shape").to_pylist() == ["triangle", "circle", "square", None]


@pytest.mark.slow  # imports datasets in a fresh process: a few seconds
def test_the_extra_query_with_hugging_face_datasets_runs_as_written(tmp_path):
    _write_output(tmp_path)
    block = _blocks("python")[1] + "\nprint(sorted(yellow['id']), sorted(rows.column_names))\n"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids, columns = done.stdout.strip().splitlines()[-1].split("] [")
    assert ids == "['r0', 'r2'"
    assert "'shape'" in columns and "'color'" in columns and "'extra'" in columns
