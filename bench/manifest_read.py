"""Reading an output's manifests: 40,000 shard manifests vs their compacted set, side by side.

    python bench/manifest_read.py                         # 40,000 manifests of 25 rows
    python bench/manifest_read.py --shards 4000 --rows 250

Writes an output of `--shards` manifests (the real schema) with `_SUCCESS`, compacts it
(driver/output/compact.py, timed), then reads the union both ways with `pyarrow.dataset`,
DuckDB (`read_parquet`, one aggregate query) and Hugging Face `datasets` (`load_dataset("parquet")`,
into a temporary cache). A JSON line per reader as soon as it is timed (seconds on each form and
their ratio), then one line with everything.

    python bench/manifest_read.py --shards 40000 --rows 25 --readers datasets   # one reader
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditfleet.driver.output.compact import compact_output  # noqa: E402
from ditfleet.workers.output.layout import manifest_key, success_key  # noqa: E402
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA  # noqa: E402
from ditfleet.workers.storage import open_store  # noqa: E402


def _template(rows: int) -> pa.Table:
    def value(f: pa.Field, i: int):
        t = f.type
        if pa.types.is_string(t):
            return f"{f.name}-{i}" if f.name not in ("uri", "sha256") else f"{f.name}-{i:064d}"
        if pa.types.is_integer(t):
            return i
        if pa.types.is_floating(t):
            return 0.25 * i
        if pa.types.is_boolean(t):
            return False
        return None

    columns = {f.name: pa.array([value(f, i) for i in range(rows)], f.type) for f in MANIFEST_SCHEMA}
    return pa.table(columns, schema=MANIFEST_SCHEMA)


def write_output(root: Path, shards: int, rows: int) -> None:
    store = open_store(str(root))
    base = _template(rows)
    id_at, shard_at = base.schema.get_field_index("id"), base.schema.get_field_index("shard")
    for s in range(shards):
        ids = pc.binary_join_element_wise(f"img-{s:06d}-", pa.array(range(rows)).cast(pa.string()), "")
        table = base.set_column(id_at, MANIFEST_SCHEMA.field("id"), ids)
        table = table.set_column(
            shard_at,
            MANIFEST_SCHEMA.field("shard"),
            pa.array([s] * rows, MANIFEST_SCHEMA.field("shard").type),
        )
        path = root / manifest_key(s)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
    store.put(success_key(), b"{}")


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def read_pyarrow(path: str) -> int:
    return ds.dataset(path, format="parquet").to_table(columns=["id", "status", "bytes"]).num_rows


def read_duckdb(glob: str) -> int:
    import duckdb

    with duckdb.connect() as con:
        return con.execute(f"SELECT count(*), sum(bytes) FROM read_parquet('{glob}')").fetchone()[0]


def read_datasets(files: list[str], cache: str) -> int:
    import datasets

    datasets.disable_progress_bars()
    return len(datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache))


READERS = ("pyarrow_dataset", "duckdb", "datasets")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=40_000)
    parser.add_argument("--rows", type=int, default=25, help="manifest rows per shard")
    parser.add_argument("--no-datasets", action="store_true", help="leave Hugging Face datasets out")
    parser.add_argument(
        "--readers", nargs="+", choices=READERS, default=list(READERS), help="readers to time (default all)"
    )
    args = parser.parse_args()
    readers = [r for r in args.readers if not (args.no_datasets and r == "datasets")]
    with tempfile.TemporaryDirectory(prefix="ditfleet-manifests-") as tmp:
        root = Path(tmp) / "out"
        generate_s, _ = _timed(lambda: write_output(root, args.shards, args.rows))
        compact_s, report = _timed(lambda: compact_output(open_store(str(root))))
        manifests, compacted = str(root / "manifests"), str(root / "compacted")
        line: dict = {
            "bench": "manifest_read",
            "shards": args.shards,
            "rows": args.shards * args.rows,
            "compacted_mib": round(report.bytes / 2**20, 1),
            "generate_s": round(generate_s, 1),
            "compact_s": round(compact_s, 2),
        }
        files = lambda folder: sorted(str(p) for p in Path(folder).glob("*.parquet"))  # noqa: E731
        forms = {
            "pyarrow_dataset": (lambda: read_pyarrow(manifests), lambda: read_pyarrow(compacted)),
            "duckdb": (
                lambda: read_duckdb(manifests + "/*.parquet"),
                lambda: read_duckdb(compacted + "/*.parquet"),
            ),
            "datasets": (
                lambda: read_datasets(files(manifests), tmp + "/hf1"),
                lambda: read_datasets(files(compacted), tmp + "/hf2"),
            ),
        }
        print(json.dumps({**line, "stage": "written"}), flush=True)
        for name in readers:
            manifests_fn, compacted_fn = forms[name]
            t_many, n_many = _timed(manifests_fn)
            t_few, n_few = _timed(compacted_fn)
            assert n_many == n_few == line["rows"], (name, n_many, n_few)
            line[f"{name}_manifests_s"] = round(t_many, 3)
            line[f"{name}_compacted_s"] = round(t_few, 3)
            line[f"{name}_speedup"] = round(t_many / t_few, 1) if t_few > 0 else None
            timed = {k: line[f"{name}_{k}"] for k in ("manifests_s", "compacted_s", "speedup")}
            print(
                json.dumps({"bench": "manifest_read", "reader": name, "shards": args.shards, **timed}),
                flush=True,
            )
        line["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
