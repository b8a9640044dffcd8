"""Issue 48, also seen: a resume refused because an input file's footer changed said "content
differs" whatever changed. It now says what did, from the per-column record `_job.json` keeps
of each input file (driver.output.job_file.input_columns) and the rows' content digests: only
the column order (the values the same), or the values of which column. Real driver processes
(tests/support/fence_entry.py) on a real Parquet input."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.paused_process import Processes
from tests.support.worker_fixtures import write_prompts


@pytest.fixture
def finished(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.parquet", 6)
    procs = Processes(
        tmp_path / "procs", {"input": str(prompts), "output": str(tmp_path / "out"), "shard_size": 3}
    )
    try:
        assert (done := procs.run("run")).rc == 0, done
        yield prompts, procs
    finally:
        procs.close()


def test_a_resume_after_only_the_column_order_changed_says_so(finished):
    prompts, procs = finished
    table = pq.read_table(prompts)
    pq.write_table(table.select(list(reversed(table.column_names))), prompts)
    refused = procs.run("resume")
    assert refused.rc == 1 and "OutputMismatch" in refused.err, refused
    assert "column order changed: ['id', 'prompt', 'width', 'height', 'seed', 'source'] -> " in refused.err, (
        refused
    )
    assert "the rows' values are the same" in refused.err and "content differs" not in refused.err, refused
    assert "values of column" not in refused.err, refused


def test_a_resume_after_a_pass_through_column_was_edited_names_the_column(finished):
    prompts, procs = finished
    table = pq.read_table(prompts)
    at = table.schema.get_field_index("source")
    edited = [v.replace("batch-", "BATCH-") for v in table.column("source").to_pylist()]
    pq.write_table(table.set_column(at, "source", pa.array(edited)), prompts)
    refused = procs.run("resume")
    assert refused.rc == 1 and "values of column 'source' changed" in refused.err, refused
    assert "column order" not in refused.err and "values are the same" not in refused.err, refused
