"""Large row groups: a warning at plan time, and a worker that reads only up to its shard's end."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import RowConfig, read_shard_rows
from ditfleet.workers.storage.input_files import STREAM_BUFFER_BYTES


class _CountingHandler(pafs.FileSystemHandler):
    """The local filesystem, counting the bytes read through files it opens."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self.bytes_read = 0

    def _counting(self, f):
        handler = self

        class Counting(io.RawIOBase):
            def readable(self):
                return True

            def seekable(self):
                return True

            def seek(self, offset, whence=0):
                return f.seek(offset, whence)

            def tell(self):
                return f.tell()

            def readinto(self, b):
                data = f.read(len(b))
                b[: len(data)] = data
                handler.bytes_read += len(data)
                return len(data)

        return pa.PythonFile(io.BufferedReader(Counting(), buffer_size=64 * 1024), mode="r")

    def open_input_file(self, path):
        return self._counting(self.local.open_input_file(path))

    def open_input_stream(self, path):
        return self._counting(self.local.open_input_file(path))

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def get_type_name(self):
        return "counting-local"

    def normalize_path(self, path):
        return path

    def equals(self, other):
        return self is other

    def _no(self, *args):
        raise NotImplementedError

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = _no
    move = copy_file = open_output_stream = open_append_stream = _no


def _one_row_group_file(path: Path, n: int) -> Path:
    table = pa.table(
        {"id": [f"r{i}" for i in range(n)], "prompt": [f"prompt {i} " + "x" * 200 for i in range(n)]}
    )
    pq.write_table(table, path, row_group_size=n, compression="none")
    return path


def test_plan_warns_about_row_groups_much_larger_than_shards(tmp_path):
    big = _one_row_group_file(tmp_path / "big.parquet", 20_000)
    plan = plan_job(PromptSource(str(big)), PlanConfig(shard_size=256))
    (warning,) = plan.warnings
    assert f"{big} (20000 rows)" in warning and "row_group_size=256" in warning
    assert plan_job(PromptSource(str(big)), PlanConfig(shard_size=8000)).warnings == ()
    small = _one_row_group_file(tmp_path / "small.parquet", 5000)  # read whole in no time
    assert plan_job(PromptSource(str(small)), PlanConfig(shard_size=5)).warnings == ()


def test_a_shard_reads_its_row_group_only_up_to_its_last_row(tmp_path):
    n = 150_000  # about 34 MB in one row group
    path = _one_row_group_file(tmp_path / "big.parquet", n)
    size = path.stat().st_size
    plan = plan_job(PromptSource(str(path)), PlanConfig(rows=RowConfig(), shard_size=256))
    first, last = plan.shards[0], plan.shards[-1]
    reads = {}
    for shard in (first, last):
        handler = _CountingHandler()
        rows = read_shard_rows(shard, pafs.PyFileSystem(handler), RowConfig())
        assert [r.id for r in rows] == [f"r{i}" for i in range(shard.row_start, shard.row_stop)]
        reads[shard.index] = handler.bytes_read
    print(f"\nfile {size} bytes; first shard read {reads[first.index]}, last {reads[last.index]}")
    # The first shard's rows are in the first pages: it stops there (one buffer per column, the
    # footer), where it used to fetch every column chunk whole.
    assert reads[first.index] < 2 * (STREAM_BUFFER_BYTES + 64 * 1024) + 256 * 1024 < size / 3
    # The last shard reads the file about once, never twice: the footer and some page headers may
    # be read again (tens of KB, depending on what earlier tests left in pyarrow's I/O state).
    assert reads[last.index] <= size + 256 * 1024 < 2 * size
