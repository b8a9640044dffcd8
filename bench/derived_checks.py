"""What issue 48's new checks cost at 1,000 shards, each against what it replaced or added to.

    python -m bench.derived_checks --shards 1000 --rows 25

- digest: the compacted set's digest over the union of the manifests, the sha256 one
  (driver.output.compact.UnionDigest) vs the 64-bit power sums it replaced (rebuilt here from
  workers.value_digests as it was), over the same tables in memory (what verify and compaction
  add per row), and the whole `compact_output` with the sha256 digest.
- fence: the compacted set's conditional write (`put_file_if` over the version read before, and
  the two `version` reads) vs a plain `put_file`, and the driver finish's look for an unreleased
  compaction among the lease documents below its own (one here).
- case: the store probe (`store_folds_case`: put, exists, delete) on a local folder, and the
  refusal's second read of the id column over --shards x --rows ids on a folding store.
- columns: `input_columns` over one input file of --shards x --rows rows (footers only).

One JSON line; seconds are medians of --rounds.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.manifest_read import write_output  # noqa: E402
from ditfleet.driver.input.prompts import PromptSource  # noqa: E402
from ditfleet.driver.input.row_errors import InputError  # noqa: E402
from ditfleet.driver.output.case_fold import refuse_ids_that_fold, store_folds_case  # noqa: E402
from ditfleet.driver.output.compact import (  # noqa: E402
    COMPACTED_KEY,
    UnionDigest,
    _unreleased_compaction,
    compact_output,
)
from ditfleet.driver.output.job_file import input_columns  # noqa: E402
from ditfleet.driver.output.lease import acquire_lease  # noqa: E402
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, read_manifests  # noqa: E402
from ditfleet.workers.rows import RowConfig  # noqa: E402
from ditfleet.workers.storage import LocalStore, open_store  # noqa: E402
from ditfleet.workers.value_digests import digests, mix  # noqa: E402


def old_union(tables: list[pa.Table]) -> tuple[int, int, int]:
    """The replaced digest: per row a 64-bit chain over every column's value digest, then the
    count and two power sums mod 2^64."""
    rows = sum1 = sum2 = 0
    for table in tables:
        n = table.num_rows
        h = np.full(n, np.uint64(len(MANIFEST_SCHEMA)), np.uint64)
        for name in MANIFEST_SCHEMA.names:
            column = table.column(name).combine_chunks()
            if pa.types.is_list(column.type):  # the source columns came after this digest was replaced
                column = pc.binary_join(column, "\x1f")
            elif not pa.types.is_string(column.type):
                column = column.cast(pa.string())
            with np.errstate(over="ignore"):
                h = mix(h * np.uint64(0x100000001B3) ^ digests(column, positions=np.zeros(n, np.int64)))
        with np.errstate(over="ignore"):
            rows += n
            sum1 = (sum1 + int(h.sum(dtype=np.uint64))) % (1 << 64)
            sum2 = (sum2 + int((h * h).sum(dtype=np.uint64))) % (1 << 64)
    return rows, sum1, sum2


def new_union(tables: list[pa.Table]) -> dict[str, object]:
    digest = UnionDigest()
    for table in tables:
        digest.add(table)
    return digest.to_dict()


def median_s(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times), 4)


class FoldingStore(LocalStore):
    """A folder that folds case (as tests/integration/test_case_fold.py makes one)."""

    def _path(self, key: str) -> str:
        path = super()._path(key)
        at = self.root
        for part in os.path.relpath(path, self.root).split(os.sep):
            try:
                part = next((n for n in os.listdir(at) if n.lower() == part.lower()), part)
            except FileNotFoundError:
                pass
            at = os.path.join(at, part)
        return at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=25, help="manifest rows (and input rows) per shard")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    line: dict[str, object] = {
        "bench": "derived_checks",
        "shards": args.shards,
        "rows": args.shards * args.rows,
    }
    with tempfile.TemporaryDirectory(prefix="ditfleet-derived-") as tmp:
        root = Path(tmp) / "out"
        write_output(root, args.shards, args.rows)
        store = open_store(str(root))
        # Per manifest, as verify and compaction feed the digest (in batches of >= 65,536 rows).
        union = read_manifests(store)
        batches = [union.slice(i, 65_536) for i in range(0, union.num_rows, 65_536)]
        line["digest_old_s"] = median_s(lambda: old_union(batches), args.rounds)
        line["digest_sha256_s"] = median_s(lambda: new_union(batches), args.rounds)
        line["digest_ratio"] = round(line["digest_sha256_s"] / max(line["digest_old_s"], 1e-9), 2)  # type: ignore[operator]
        line["compact_s"] = median_s(lambda: compact_output(store), args.rounds)

        data = (root / COMPACTED_KEY).read_bytes()
        line["set_put_file_s"] = median_s(
            lambda: store.put_file(COMPACTED_KEY, io.BytesIO(data)), args.rounds
        )
        line["set_put_file_if_s"] = median_s(
            lambda: store.put_file_if(COMPACTED_KEY, io.BytesIO(data), store.version(COMPACTED_KEY)),
            args.rounds,
        )
        with acquire_lease(store, renew=False, compacts=True):
            pass
        with acquire_lease(store, renew=False) as lease:
            line["unreleased_compaction_look_s"] = median_s(
                lambda: _unreleased_compaction(store, lease), args.rounds
            )

        line["case_probe_s"] = median_s(lambda: store_folds_case(store), args.rounds)
        ids = [f"Img-{i:07d}" for i in range(args.shards * args.rows)]
        prompts = Path(tmp) / "prompts.parquet"
        pq.write_table(pa.table({"id": ids, "prompt": ["a red circle"] * len(ids)}), prompts)
        folding = FoldingStore(str(Path(tmp) / "folding"))
        source = PromptSource(str(prompts))

        def fold_check() -> None:
            try:
                refuse_ids_that_fold(folding, source, RowConfig(), "files")
            except InputError as e:  # none collide here
                raise AssertionError(e) from e

        line["case_fold_check_s"] = median_s(fold_check, args.rounds)
        line["input_columns_s"] = median_s(lambda: input_columns(source, [str(prompts)]), args.rounds)
    line["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
