"""Supersession: once a redo's generation g of a shard is committed, the lower generations leave
the reader-visible folders, kept whole under `_superseded/`.

Superseding generation c (a permanent fact once g exists) needs only c's own manifest and
objects, in this order, each step idempotent, so anyone can resume it after a crash at any point:
1. copy manifest c's bytes to `_superseded/manifests/<its name>` (create-only);
2. copy every object its ok rows name to `_superseded/<its key>` (create-only, `store.copy`);
3. overwrite manifest c's key with a tombstone (zero rows, MANIFEST_SCHEMA, saying g and
   listing the object keys c's ok rows named): the key stays occupied, so no straggler of c can
   commit it again, and a reader of manifests/ reads nothing from it;
4. delete the sources of step 2: they live on under `_superseded/`, which every reader skips.
A tombstone whose objects are still in the data areas is a supersession stopped between 3 and
4: the next one finishes it from the tombstone's list alone (copying again what is no longer
under `_superseded/`), so `_superseded/` is history that nothing reads: deleting it, by hand or
by a bucket lifecycle rule, at any time, never blocks or changes a later supersession. A
tombstone written before tombstones listed their objects is read from its copy under
`_superseded/`; when that copy is gone too, whatever of its generation is still in the data
areas and no readable manifest names is moved under `_superseded/` (kept, never deleted).
Nothing is deleted that is not first kept under `_superseded/`. A lower generation that cannot
be superseded (its manifest cannot be read, or names objects outside the layout; its copy under
`_superseded/` differs) is reported as blocked: the driver then does not write `_SUCCESS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ditfleet.driver.output.orphans import ShardRecord, read_shard_record
from ditfleet.driver.output.pause_points import pause_point
from ditfleet.workers.output.formats import attempt_object, attempt_prefixes
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

_PARQUET = "application/vnd.apache.parquet"


class SupersedeError(ValueError):
    """A generation cannot be superseded safely (its copy under `_superseded/` differs, or a
    manifest of the shard cannot be read): the output is damaged, the message names where."""


@dataclass
class Superseded:
    """What a pass did: (shard, generation) superseded or finished, named objects that were
    in neither place (lost before; verify names them), and the lower generations it could not
    supersede, each with why (naming the key)."""

    generations: list[tuple[int, int]] = field(default_factory=list)
    moved: int = 0
    missing: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)


def current_generation(record: ShardRecord) -> int | None:
    """The shard's current generation: its highest that is not a seal."""
    live = [g for g, kind in record.kinds.items() if kind != SEALED]
    return max(live) if live else None


def lower_generations(record: ShardRecord) -> list[int]:
    """The generations below the current one that are superseded (or to be): not seals; one
    whose key cannot be read is among them (it blocks `_SUCCESS`)."""
    current = current_generation(record)
    if current is None:
        return []
    lower = {g for g, kind in record.kinds.items() if g < current and kind in (MANIFEST, SUPERSEDED)}
    return sorted(lower | {g for g in record.unaccounted if g < current})


def left_in_data_areas(record: ShardRecord, generation: int, listed: set[str]) -> list[str]:
    """The objects of a superseded (tombstoned) generation still in the data areas (`listed`):
    those it names; for one whose history is gone, every object of its generation (and of
    generation 0, whose plain tokens the redos of earlier versions shared) that no readable
    manifest of the shard names."""
    if generation not in record.history_gone:
        return sorted(k for k in record.named_by.get(generation, ()) if k in listed)
    left = []
    for key in listed:
        obj = attempt_object(key)
        if obj is not None and obj.generation in (generation, 0) and obj.attempt not in record.named:
            left.append(key)
    return sorted(left)


def _shard_objects(store: ObjectStore, shard: int) -> set[str]:
    return {k for prefix in attempt_prefixes(shard) for k in store.list(prefix)}


def _move(store: ObjectStore, sources: Iterable[str], done: Superseded) -> list[str]:
    """Step 2: copy each source under `_superseded/`; returns those now kept there."""
    copied = []
    for source in sources:
        try:
            if store.copy(source, superseded_key(source)):
                done.moved += 1
            copied.append(source)
        except ObjectNotFound:
            done.missing.append(source)
    return copied


def supersede_generation(
    store: ObjectStore, record: ShardRecord, generation: int, by: int, done: Superseded
) -> None:
    """Steps 1-4 (module docstring) for one lower generation of `record`'s shard whose key
    holds rows, superseded by `by`: needs only that generation's manifest and objects. Raises
    SupersedeError when its copy under `_superseded/` holds other bytes."""
    key = manifest_key(record.shard, generation)
    data = store.get(key)
    # Another supersession may have written the tombstone since `record` was read.
    rows_there = manifest_kind(data).kind == MANIFEST
    if rows_there and not store.put_if_absent(superseded_key(key), data, _PARQUET):
        raise SupersedeError(
            f"{store.uri(superseded_key(key))} holds other bytes than {store.uri(key)}: the "
            "history of this generation was changed by hand; move it away, then run again"
        )
    named = record.named_by.get(generation, ())
    current = set(record.named_by.get(by, ()))
    copied = _move(store, [k for k in dict.fromkeys(named) if k not in current], done)
    if rows_there:
        store.put(key, tombstone_bytes(by, named), _PARQUET)
    pause_point("supersede_before_delete")
    for source in copied:
        store.delete(source)
    done.generations.append((record.shard, generation))


def supersede_shard(store: ObjectStore, record: ShardRecord, done: Superseded) -> None:
    """Supersede (or finish superseding) every lower generation of one shard that still has
    rows in manifests/ or objects in the data areas; what cannot be is added to done.blocked."""
    lower = lower_generations(record)
    if not lower:
        return
    by: int = current_generation(record)  # type: ignore[assignment]  # lower is not empty
    if by in record.unaccounted:
        done.blocked.append(
            f"shard {record.shard}: generation(s) {lower} are superseded by generation {by}, but "
            f"{record.unaccounted[by]}: nothing of them is moved (restore that manifest, then run "
            "`ditfleet verify --clean`)"
        )
        return
    listed: set[str] | None = None
    for g in lower:
        if g in record.unaccounted:
            done.blocked.append(
                f"shard {record.shard}: generation {g} is superseded by generation {by}, but "
                f"{record.unaccounted[g]}: it cannot be moved out of the reader folders (restore "
                "that manifest, then run `ditfleet verify --clean`)"
            )
        elif record.kinds[g] == MANIFEST:
            try:
                supersede_generation(store, record, g, by, done)
            except SupersedeError as e:
                done.blocked.append(f"shard {record.shard}: {e}")
        else:
            if listed is None:
                listed = _shard_objects(store, record.shard)
            left = left_in_data_areas(record, g, listed)
            if left:  # a supersession stopped between steps 3 and 4: finish it
                for source in _move(store, left, done):
                    store.delete(source)
                done.generations.append((record.shard, g))


def supersede_pending(store: ObjectStore, shards: Iterable[int] | None = None) -> Superseded:
    """Supersede (or finish superseding) every lower generation of `shards` (None: every shard)
    that still has rows or objects in the reader-visible folders. Only shards with more than one
    generation's key are read."""
    total = Superseded()
    listed = manifest_generations(store.list(MANIFESTS_PREFIX))
    wanted = set(listed) if shards is None else set(shards) & set(listed)
    for shard in sorted(s for s in wanted if len(listed[s]) > 1):
        supersede_shard(store, read_shard_record(store, shard, listed[shard]), total)
    return total
