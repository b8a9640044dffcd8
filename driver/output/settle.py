"""Settling the lease documents of earlier drivers: what a crashed or paused run left open is
closed for good before this driver plans dispatch, cleans up or writes `_SUCCESS`.

For each older document (a lower lease generation, so no longer the output's owner) that is not
marked settled, every redo generation (S, g) it lists whose manifest key is absent gets a seal,
written create-only (workers.output.manifest.seal_bytes). Both the seal and a straggler's
commit race for that one create-only key: if the seal wins, nothing of (S, g) can ever commit;
if the commit won, it is real and the supersession pass (driver.output.supersede) moves the
lower generation away. Either way (S, g) is settled forever. The document's shards are returned
for the clean-up (a document of an earlier version, without them: every shard).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ditfleet.driver.output.lease import lease_generations, read_lease_document, shards_of_ranges
from ditfleet.workers.output.layout import lease_key, manifest_key
from ditfleet.workers.output.manifest import seal_bytes
from ditfleet.workers.storage import ObjectStore


@dataclass
class Settled:
    """What settling the older documents found: their generations, the shards their runs may
    have left orphans in (None: any shard), and the redo generations sealed."""

    documents: list[int] = field(default_factory=list)
    shards: set[int] | None = field(default_factory=set)
    sealed: list[tuple[int, int]] = field(default_factory=list)


def seal_generations(store: ObjectStore, redo: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Seal each (shard, generation) whose manifest key is absent; returns those this call
    sealed (a key a commit took first is left as it is: that commit is real)."""
    sealed = []
    data = seal_bytes()
    for shard, generation in redo:
        if generation < 1:
            raise ValueError(
                f"only a redo generation (>= 1) is sealed, got shard {shard} generation {generation}"
            )
        key = manifest_key(shard, generation)
        if store.put_if_absent(key, data, "application/vnd.apache.parquet"):
            sealed.append((shard, generation))
    return sealed


def _redo_of(doc: dict) -> list[tuple[int, int]]:
    redo = doc.get("redo")
    if not isinstance(redo, dict):
        return []
    return [(int(s), g) for s, g in redo.items() if str(s).isdigit() and isinstance(g, int) and g >= 1]


def settle_older(store: ObjectStore, generation: int) -> Settled:
    """Settle every lease document below `generation` (the caller's, held) not marked settled."""
    settled = Settled()
    for older in lease_generations(store):
        if older >= generation:
            continue
        doc = read_lease_document(store, older)
        settled.documents.append(older)
        if doc is None or doc.get("settled"):
            continue
        settled.sealed += seal_generations(store, _redo_of(doc))
        shards = shards_of_ranges(doc.get("shards"))
        if shards is None or settled.shards is None:
            settled.shards = None
        else:
            settled.shards |= shards
    return settled


def delete_settled(store: ObjectStore, generations: Iterable[int], holder: int) -> None:
    """Delete the older documents this driver settled; never the holder's own, which is the
    highest, nor any above it."""
    for g in generations:
        if g < holder:
            store.delete(lease_key(g))
