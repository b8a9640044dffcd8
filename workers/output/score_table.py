"""Score tables: what one image scorer says of the ok images of one committed shard manifest,
written beside the output and never into it.

A table lives at `scores/{scorer}/{the manifest's file name}` (layout.score_table_key), one row per
ok image of that manifest: its id, k, uri and sha256 and the score (null where the scorer cannot
judge, e.g. `tiny` on a prompt outside its template). A reader joins a table to the manifests on
(id, k, uri): (id, k) is the image (the uri alone is not: every row of a "parquet" or
"webdataset" shard names the same data file or tar), and the uri names the generation's own
objects, so a table made from a superseded generation can never attach to a redo's rows.

A redo does not rescore: after it, the redone shard's table is one of a superseded generation
and its current manifest has none. `score_tables` says so for `ditfleet status`, `preview` and
`report`; `ditfleet score` makes the missing tables (docs/quality.md). The file's metadata names the scorer and the manifest it was made from. A table is
written create-only and whole: a killed scorer leaves none or the complete one; two scorers of the
same manifest write the same rows, and the second write finds the first.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.workers.output.formats import MANIFEST_IMAGE_COLUMNS, ok_images, read_images
from ditfleet.workers.output.layout import (
    SCORES_PREFIX,
    manifest_of_key,
    manifest_of_score_table,
    score_table_key,
)
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


@dataclass(frozen=True)
class ScoreTables:
    """One scorer's tables against the current manifests: which have one, and which shards have
    none made from their current generation (a redo since `ditfleet score`, or never scored)."""

    scorer: str
    made: frozenset[str]  # current manifest keys with a table of this scorer
    # shard -> (generation of its newest table, the shard's current generation): a redo since
    stale: Mapping[int, tuple[int, int]]
    unscored: tuple[int, ...]  # shards with no table of any generation

    def behind(self, shards: Iterable[int] | None = None) -> list[int]:
        """The shards (of `shards`, default all) whose current manifest has no table."""
        behind = sorted({*self.stale, *self.unscored})
        return behind if shards is None else sorted(set(behind) & set(shards))

    def note(self, root: str, shards: Iterable[int] | None = None) -> str | None:
        """One line naming the shards (of `shards`) without a table of their current generation
        and the command that makes them; None when there are none."""
        behind = self.behind(shards)
        if not behind:
            return None
        parts = []
        stale = [s for s in behind if s in self.stale]
        if stale:
            said = ", ".join(
                f"{s} (table of generation {self.stale[s][0]}, now {self.stale[s][1]})" for s in stale[:5]
            )
            parts.append(f"shards redone since they were scored: {said}{' ...' if len(stale) > 5 else ''}")
        unscored = [s for s in behind if s not in self.stale]
        if unscored:
            parts.append(f"shards never scored: {_shard_list(unscored)}")
        return (
            f"scores/{self.scorer}/ does not cover {len(behind)} shard(s), whose images have no "
            f"{self.scorer} score: {'; '.join(parts)}. Run `ditfleet score {root} --scorer {self.scorer}`"
        )


def _shard_list(shards: list[int], most: int = 10) -> str:
    return ", ".join(map(str, shards[:most])) + (" ..." if len(shards) > most else "")


def score_tables(store: ObjectStore, scorer: str, current: Mapping[int, str]) -> ScoreTables:
    """`scorer`'s tables against `current` (shard -> current manifest key), by one listing of
    scores/{scorer}/."""
    return _tables_of(scorer, store.list(f"{SCORES_PREFIX}{scorer}/"), current)


def all_score_tables(store: ObjectStore, current: Mapping[int, str]) -> list[ScoreTables]:
    """Every scorer's tables (a folder under scores/ with a table in it), by one listing of scores/."""
    by_scorer: dict[str, list[str]] = {}
    for key in store.list(SCORES_PREFIX):
        by_scorer.setdefault(key[len(SCORES_PREFIX) :].split("/", 1)[0], []).append(key)
    found = [_tables_of(scorer, keys, current) for scorer, keys in sorted(by_scorer.items())]
    return [t for t in found if t.made or t.stale]


def _tables_of(scorer: str, keys: Iterable[str], current: Mapping[int, str]) -> ScoreTables:
    newest: dict[int, int] = {}  # shard -> the highest generation it has a table of
    made: set[str] = set()
    for key in keys:
        manifest = manifest_of_score_table(scorer, key)
        parsed = manifest_of_key(manifest) if manifest else None
        if manifest is None or parsed is None:
            continue  # not a table of ours
        made.add(manifest)
        newest[parsed[0]] = max(parsed[1], newest.get(parsed[0], -1))
    stale: dict[int, tuple[int, int]] = {}
    unscored: list[int] = []
    for shard, key in sorted(current.items()):
        if key in made:
            continue
        generation = (manifest_of_key(key) or (shard, 0))[1]
        if shard in newest and newest[shard] < generation:
            stale[shard] = (newest[shard], generation)
        else:
            unscored.append(shard)
    return ScoreTables(scorer, frozenset(made & set(current.values())), stale, tuple(unscored))
