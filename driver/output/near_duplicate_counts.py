"""Near duplicates over an output's committed images, from the manifests' `phash` column.

`ditfleet status`, the driver's `_SUCCESS` and `ditfleet report` all count them here, over the
current manifest of each committed shard (workers.output.manifest.current_manifest_keys: a redo's
superseded generation is not read, so every image counts once), in shard order and row order
within a shard: an image counts when an earlier one is near it (workers.near_duplicates).

Bounded: the count covers at most NEAR_DUPLICATE_LIMIT images, the first in that order, and says
so when it stops there. At the limit it holds 16 bytes per image (the hash and its prompt's
digest; 16 MB) plus about 20 while it sorts, and takes about 6 s on one core for spread-out
hashes; the work grows with the square of the images (3 million took 73 s), so a 100-million-
image job is counted over its first million, not whole. Manifests without the column (older
outputs) add nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.workers.near_duplicates import NEAR_DUPLICATE_BITS, count_near_duplicates
from ditfleet.workers.output.manifest import current_manifest_keys
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import READ_THREADS
from ditfleet.workers.storage.parquet_bytes import read_parquet
from ditfleet.workers.value_digests import digests

NEAR_DUPLICATE_LIMIT = 1_000_000  # images counted at most (the module says what it costs)


def near_duplicates_of(table: pa.Table, limit: int = NEAR_DUPLICATE_LIMIT) -> dict[str, Any]:
    """Counts over a manifest table in output order (rows with a phash, the first `limit` of them):
    {images, same_prompt, across_prompts, limited}; {} when no row has a phash."""
    if "phash" not in table.column_names:
        return {}
    has = pc.is_valid(table.column("phash"))
    hashes = pc.filter(table.column("phash"), has).to_numpy().view(np.uint64)
    if not len(hashes):
        return {}
    prompts = digests(pc.filter(table.column("prompt"), has))
    counts = count_near_duplicates(hashes[:limit], prompts[:limit])
    return {**counts.to_dict(), "limited": len(hashes) > limit}


def _read_hashes(store: ObjectStore, key: str) -> pa.Table:
    return read_parquet(store.get(key), ["prompt"], if_present=["phash"])


def output_near_duplicates(
    store: ObjectStore, shards: list[int] | None = None, limit: int = NEAR_DUPLICATE_LIMIT
) -> dict[str, Any]:
    """Counts over the committed `shards` (None: every committed shard) of the output in `store`,
    as near_duplicates_of says. Reads two columns, and stops reading once `limit` images are in."""
    current = current_manifest_keys(store)
    keys = [current[s] for s in sorted(current if shards is None else set(shards) & set(current))]
    tables: list[pa.Table] = []
    held = 0
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        for start in range(0, len(keys), READ_THREADS):
            for table in pool.map(lambda k: _read_hashes(store, k), keys[start : start + READ_THREADS]):
                if "phash" in table.column_names:  # older manifests have none
                    tables.append(table.filter(pc.is_valid(table.column("phash"))))
                    held += tables[-1].num_rows
            if held > limit:  # one past the limit tells near_duplicates_of that it was cut
                break
    if not tables:
        return {}
    return near_duplicates_of(pa.concat_tables(tables), limit)


def near_duplicate_line(counts: dict[str, Any]) -> str:
    """'2 of 48 images repeat another seed of their prompt, 1 another prompt's image'."""
    line = (
        f"{counts['same_prompt']} of {counts['images']} images repeat another seed of their prompt, "
        f"{counts['across_prompts']} another prompt's image (perceptual hashes within {NEAR_DUPLICATE_BITS} bits)"
    )
    if counts.get("limited"):
        line += f"; counted over the first {counts['images']} images in shard order, not all"
    return line
