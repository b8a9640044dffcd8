"""Write jobs/examples/prompts.parquet: 48 captions the bundled tiny model knows, deterministically.

    python jobs/examples/make_prompts.py [--out jobs/examples/prompts.parquet]

48 of the tiny model's training captions (model.tiny.scenes), picked by a hash of the text. A third
of the rows ask for a landscape or portrait size, every fourth row brings its own seed, and two
columns (shape, color) pass through to the manifests. Same bytes on every run.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ditfleet.model.tiny.scenes import split_scenes  # noqa: E402

ROWS = 48
SIZES = [(None, None), (160, 96), (96, 160)]  # None: the job's default bucket (128x128)


def prompts_table(rows: int = ROWS) -> pa.Table:
    # Training scenes (the model knows them), in an order that mixes every attribute: by a
    # hash of the caption, which is the same everywhere.
    train, _ = split_scenes()
    picked = sorted(train, key=lambda s: hashlib.sha256(b"example:" + s.caption.encode()).hexdigest())[:rows]
    sizes = [SIZES[i % 3] for i in range(rows)]
    return pa.table(
        {
            "id": [f"shape-{i:03d}" for i in range(rows)],
            "prompt": [s.caption for s in picked],
            "width": pa.array([w for w, _ in sizes], pa.int32()),
            "height": pa.array([h for _, h in sizes], pa.int32()),
            "seed": pa.array([1000 + i if i % 4 == 0 else None for i in range(rows)], pa.int64()),
            "shape": [s.shape for s in picked],
            "color": [s.color for s in picked],
        }
    )


def write_example(table: pa.Table, name: str, description: str, what: str) -> None:
    """Write `table` to --out (default: `name` next to this file), zstd-compressed, and say so."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=str(Path(__file__).with_name(name)))
    args = parser.parse_args()
    pq.write_table(table, args.out, compression="zstd")
    print(f"wrote {table.num_rows} {what} to {args.out}")


def main() -> None:
    write_example(prompts_table(), "prompts.parquet", __doc__.splitlines()[0], "prompts")


if __name__ == "__main__":
    main()
