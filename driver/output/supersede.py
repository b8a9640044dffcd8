"""Supersession: once a redo's generation g of a shard is committed, the lower generations leave
the reader-visible folders, kept whole under `_superseded/`.

Superseding generation c (a permanent fact once g exists), in this order, each step idempotent,
so anyone can resume it after a crash at any point:
1. copy manifest c's bytes to `_superseded/manifests/<its name>` (create-only);
2. copy every object its ok rows name to `_superseded/<its key>` (create-only, `store.copy`);
3. overwrite manifest c's key with a tombstone (zero rows, MANIFEST_SCHEMA, saying g): the key
   stays occupied, so no straggler of c can commit it again, and a reader of manifests/ reads
   nothing from it;
4. delete the sources of step 2: they live on under `_superseded/`, which every reader skips.
A tombstone whose sources are still in the data areas is a supersession stopped between 3 and
4: the next one finishes it. Nothing is deleted that is not first kept under `_superseded/`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ditfleet.driver.output.orphans import ShardRecord, read_shard_record
from ditfleet.workers.output.formats import attempt_prefixes
from ditfleet.workers.output.layout import MANIFESTS_PREFIX, manifest_key, superseded_key
from ditfleet.workers.output.manifest import (
    MANIFEST,
    SEALED,
    SUPERSEDED,
    manifest_generations,
    manifest_kind,
    tombstone_bytes,
)
from ditfleet.workers.storage import ObjectNotFound, ObjectStore


class SupersedeError(RuntimeError):
    """A generation cannot be superseded safely (its copy under `_superseded/` differs)."""


@dataclass
class Superseded:
    """What a pass did: (shard, generation) superseded or finished, and named objects that were
    in neither place (lost before; verify names them)."""

    generations: list[tuple[int, int]] = field(default_factory=list)
    moved: int = 0
    missing: list[str] = field(default_factory=list)


def current_generation(record: ShardRecord) -> int | None:
    """The shard's current generation: its highest that is not a seal."""
    live = [g for g, kind in record.kinds.items() if kind != SEALED]
    return max(live) if live else None


def pending_generations(store: ObjectStore, record: ShardRecord) -> list[int]:
    """The lower generations of the shard that still have rows in manifests/ or objects in the
    data areas: a supersession not done, or stopped before its end."""
    current = current_generation(record)
    if current is None:
        return []
    lower = [g for g, kind in record.kinds.items() if g < current and kind in (MANIFEST, SUPERSEDED)]
    if not lower:
        return []
    listed: set[str] | None = None
    pending = []
    for g in sorted(lower):
        if record.kinds[g] == MANIFEST:
            pending.append(g)
            continue
        if listed is None:
            listed = {k for prefix in attempt_prefixes(record.shard) for k in store.list(prefix)}
        if any(k in listed for k in record.named_by.get(g, ())):
            pending.append(g)
    return pending


def supersede_generation(
    store: ObjectStore, record: ShardRecord, generation: int, by: int, done: Superseded
) -> None:
    """Steps 1-4 (module docstring) for one generation of `record`'s shard, superseded by `by`;
    what it did is added to `done`."""
    key = manifest_key(record.shard, generation)
    rows_there = False
    if record.kinds.get(generation) == MANIFEST:
        data = store.get(key)
        # Another supersession may have written the tombstone since `record` was read.
        rows_there = manifest_kind(data).kind == MANIFEST
    if rows_there:
        if not store.put_if_absent(superseded_key(key), data, "application/vnd.apache.parquet"):
            raise SupersedeError(
                f"{store.uri(superseded_key(key))} holds other bytes than {store.uri(key)}: the "
                "history of this generation was changed by hand; move it away, then run again"
            )
    current = set(record.named_by.get(by, ()))
    sources = [k for k in dict.fromkeys(record.named_by.get(generation, ())) if k not in current]
    copied = []
    for source in sources:
        try:
            if store.copy(source, superseded_key(source)):
                done.moved += 1
            copied.append(source)
        except ObjectNotFound:
            done.missing.append(source)
    if rows_there:
        store.put(key, tombstone_bytes(by), "application/vnd.apache.parquet")
    for source in copied:
        store.delete(source)
    done.generations.append((record.shard, generation))


def supersede_pending(store: ObjectStore, shards: Iterable[int] | None = None) -> Superseded:
    """Supersede (or finish superseding) every lower generation of `shards` (None: every shard)
    that still has rows or objects in the reader-visible folders. Only shards with more than one
    generation's key are read."""
    total = Superseded()
    listed = manifest_generations(store.list(MANIFESTS_PREFIX))
    wanted = set(listed) if shards is None else set(shards) & set(listed)
    for shard in sorted(s for s in wanted if len(listed[s]) > 1):
        record = read_shard_record(store, shard, listed[shard])
        if not record.accounted:
            continue  # a manifest that cannot be read, or names foreign objects: verify says so
        by = current_generation(record)
        for generation in pending_generations(store, record):
            supersede_generation(store, record, generation, by, total)  # type: ignore[arg-type]
    return total
