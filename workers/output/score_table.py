"""Score tables: what one image scorer says of the ok images of one committed shard manifest,
written beside the output and never into it.

A table lives at `scores/{scorer}/{the manifest's file name}` (layout.score_table_key), one row per
ok image of that manifest: its id, k, uri and sha256 (the join keys a reader uses: the uri names
the generation's own objects, so a table made from a superseded generation can never attach to a
redo's rows) and the score (null where the scorer cannot judge, e.g. `tiny` on a prompt outside
its template). The file's metadata names the scorer and the manifest it was made from. A table is
written create-only and whole: a killed scorer leaves none or the complete one; two scorers of the
same manifest write the same rows, and the second write finds the first.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.workers.output.formats import MANIFEST_IMAGE_COLUMNS, ok_images, read_images
from ditfleet.workers.output.layout import score_table_key
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.parquet_bytes import read_parquet

if TYPE_CHECKING:  # torch, which listing and reading tables do not need
    from ditfleet.model.quality.base import ImageScorer

SCORE_TABLE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("k", pa.int32(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("sha256", pa.string()),
        pa.field("score", pa.float64()),  # null: the scorer cannot judge this image
    ]
)


def score_manifest(store: ObjectStore, manifest: str, scorer: ImageScorer) -> pa.Table:
    """The score table of the manifest at key `manifest`: each ok image read back through its
    format's reader and scored with `scorer` (built once by the caller: workers.scorers)."""
    import torch
    from PIL import Image

    table = read_parquet(store.get(manifest), [*MANIFEST_IMAGE_COLUMNS, "prompt"])
    prompts = {(r["id"], r["k"]): r["prompt"] for r in table.select(["id", "k", "prompt"]).to_pylist()}
    rows, scores = ok_images(table), []
    for row, blob in read_images(store, rows):  # each stored object read once
        pixels = torch.from_numpy(np.array(Image.open(io.BytesIO(blob)).convert("RGB"))).permute(2, 0, 1)
        scores += scorer.score(pixels[None], [prompts[(row.id, row.k)]])  # (1, 3, H, W) uint8
    columns: dict[str, Any] = {
        "id": [r.id for r in rows],
        "k": [r.k for r in rows],
        "uri": [r.uri for r in rows],
        "sha256": [r.sha256 for r in rows],
        "score": [None if math.isnan(s) else s for s in scores],
    }
    metadata = {"ditfleet.scorer": scorer.name, "ditfleet.manifest": manifest}
    return pa.table(columns, schema=SCORE_TABLE_SCHEMA.with_metadata(metadata))


def write_score_table(store: ObjectStore, manifest: str, scorer: ImageScorer) -> int:
    """Score the manifest and store its table create-only; returns the images scored, or 0 when
    another scorer's table of that manifest was there first (it holds the same scores)."""
    table = score_manifest(store, manifest, scorer)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    won = store.put_if_absent(score_table_key(scorer.name, manifest), buffer.getvalue())
    return table.num_rows if won else 0
