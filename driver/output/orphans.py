"""Which objects of an output its committed records account for, and the one rule by which
anything in the data areas is deleted.

The rule (lock-free): an attempt object of shard S, generation g (its key says which,
workers.output.layout), token T, is *provably lost* iff the manifest key of (S, g) exists and was
read, and no ok row of any manifest of S that was read names T. That key holds a manifest, a
tombstone (a superseded generation, whose rows are read from its copy under `_superseded/`) or
a seal (an abandoned generation: no rows). A manifest key, once written, is never freed and its
rows never change (a superseded manifest's rows are kept whole), and a run of generation g can
commit only at (S, g): so a verdict "lost" stays true forever, and a process paused for any
length of time between reading and deleting cannot delete anything that was not already lost.
An object of a generation whose key does not exist is in play and is never deleted. Reading
every generation of S keeps outputs of earlier versions safe (their redo objects carry plain,
generation-0 tokens). What cannot be accounted for is never deleted: a shard with a manifest
that cannot be read, or one whose ok rows name anything but its own attempt objects, loses
nothing.

Used by the driver's finish (driver.output.finish), `ditfleet verify --clean`
(driver.output.verify) and a resume's check for lost objects (driver.rerun).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow.compute as pc

from ditfleet.workers.output.formats import FORMAT_AREAS, attempt_object, attempt_prefixes, object_key
from ditfleet.workers.output.layout import MANIFESTS_PREFIX, superseded_key
from ditfleet.workers.output.manifest import (
    SEALED,
    SUPERSEDED,
    current_manifest_keys,
    manifest_generations,
    manifest_kind,
)
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import READ_THREADS, check_key
from ditfleet.workers.storage.parquet_bytes import read_parquet


def manifest_object_key(root: str, shard: int, uri: object) -> tuple[str | None, str | None]:
    """(the key of a manifest row's uri, None) when it is an attempt object of `shard` in this
    layout, else (None, why not). Nothing else is ever opened or deleted on a manifest's word."""
    if not isinstance(uri, str) or not uri:
        return None, f"uri {uri!r} is not a location"
    key, _ = object_key(root, uri)
    if key is None:
        return None, f"uri {uri} is not under {root}"
    try:
        check_key(key)
    except ValueError:
        return None, f"uri {uri} is not a plain key under the output ({key!r})"
    obj = attempt_object(key)
    if obj is None or obj.shard != shard:
        return None, f"uri {uri} is not an object of shard {shard} in the output layout"
    return key, None


@dataclass(frozen=True)
class ShardRecord:
    """What the committed records of one shard prove, as read: which generations' manifest keys
    exist (and what each holds), the tokens any of their ok rows name, and whether every
    manifest was read and names only the shard's own attempt objects."""

    shard: int
    kinds: Mapping[int, str]  # generation -> MANIFEST, SUPERSEDED or SEALED
    named: frozenset[str]
    accounted: bool
    areas: frozenset[str]  # the data areas ok rows name objects in ("images/", ...)
    named_by: Mapping[int, tuple[str, ...]]  # generation -> the object keys its ok rows name

    def is_lost(self, key: str) -> bool:
        """The one rule (module docstring) for the object at `key`."""
        obj = attempt_object(key)
        return (
            self.accounted
            and obj is not None
            and obj.shard == self.shard
            and obj.generation in self.kinds
            and obj.attempt not in self.named
        )


def _ok_uris(manifest: bytes) -> list:
    """The uris of a manifest's ok rows."""
    table = read_parquet(manifest, ["status", "uri"])
    return pc.filter(table.column("uri"), pc.equal(table.column("status"), "ok")).to_pylist()


def _ok_keys(root: str, shard: int, data: bytes) -> tuple[list[str], bool]:
    keys: list[str] = []
    for uri in _ok_uris(data):
        key, _ = manifest_object_key(root, shard, uri)
        if key is None:
            return keys, False
        keys.append(key)
    return keys, True


def read_shard_record(store: ObjectStore, shard: int, keys: Mapping[int, str]) -> ShardRecord:
    """Read every generation's manifest key of `shard` (`keys`: generation -> key, as listed);
    a tombstone's rows are read from its copy under `_superseded/`."""
    root = store.uri()
    kinds: dict[int, str] = {}
    named_by: dict[int, tuple[str, ...]] = {}
    accounted = True
    for generation, key in sorted(keys.items()):
        try:
            data = store.get(key)
            kind = manifest_kind(data).kind
            if kind == SUPERSEDED:
                data = store.get(superseded_key(key))
            named, readable = ([], True) if kind == SEALED else _ok_keys(root, shard, data)
        except Exception:  # noqa: BLE001 - absent meanwhile or unreadable: nothing of the shard is proved lost
            accounted = False
            continue
        kinds[generation] = kind
        named_by[generation] = tuple(named)
        accounted = accounted and readable
    every = [k for keys_ in named_by.values() for k in keys_]
    return ShardRecord(
        shard,
        kinds,
        frozenset(attempt_object(k).attempt for k in every),  # type: ignore[union-attr]  # checked above
        accounted,
        frozenset(k.split("/", 1)[0] + "/" for k in every),
        named_by,
    )


def shard_lost_objects(store: ObjectStore, record: ShardRecord) -> list[str]:
    """The attempt objects of the shard's data areas that `record` proves lost."""
    if not record.accounted or not record.kinds:
        return []
    # One output has one format: list only its area when a manifest names an object there.
    prefixes = [
        p
        for p in attempt_prefixes(record.shard)
        if not record.areas or p.split("/", 1)[0] + "/" in record.areas
    ]
    return [key for prefix in prefixes for key in store.list(prefix) if record.is_lost(key)]


def shard_records(
    store: ObjectStore, shards: Iterable[int] | None = None, workers: int = READ_THREADS
) -> dict[int, ShardRecord]:
    """The records of `shards` (None: every shard with a manifest key) from one listing of
    manifests/."""
    listed = manifest_generations(store.list(MANIFESTS_PREFIX))
    wanted = sorted(listed if shards is None else set(shards) & set(listed))
    if not wanted:
        return {}
    with ThreadPoolExecutor(max_workers=min(workers, len(wanted))) as pool:
        records = pool.map(lambda s: read_shard_record(store, s, listed[s]), wanted)
        return {r.shard: r for r in records}


def delete_keys(store: ObjectStore, keys: list[str], workers: int = READ_THREADS) -> int:
    """Delete `keys`, a few at a time; returns how many."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(store.delete, keys))
    return len(keys)


def delete_lost(
    store: ObjectStore,
    shards: Iterable[int] | None = None,
    before_delete: Callable[[], None] | None = None,
    workers: int = READ_THREADS,
) -> int:
    """Delete the objects of `shards` (None: all) that the one rule proves lost; returns how
    many. `before_delete` runs between the verdicts and the deletions (a pause point: a
    verdict stays true however long that takes). Needs no lease."""
    records = shard_records(store, shards, workers)
    if not records:
        return 0
    with ThreadPoolExecutor(max_workers=min(workers, len(records))) as pool:
        lost = [
            k for keys in pool.map(lambda r: shard_lost_objects(store, r), records.values()) for k in keys
        ]
    if before_delete is not None:
        before_delete()
    return delete_keys(store, lost, workers) if lost else 0


def missing_named_objects(store: ObjectStore) -> dict[int, list[str]]:
    """Shard -> keys its committed manifest names (ok rows) that a listing of the data areas
    does not show: a check by listing only, no object is read. A manifest that cannot be read
    counts as missing its manifest key."""
    named: dict[int, set[str]] = {}
    root = store.uri()
    current = current_manifest_keys(store)
    for shard in sorted(current):
        key = current[shard]
        try:
            uris = _ok_uris(store.get(key))
        except Exception:  # noqa: BLE001 - an unreadable commit is as bad as a lost object
            named[shard] = {key}
            continue
        named[shard] = {manifest_object_key(root, shard, uri)[0] or f"{key}: {uri}" for uri in uris}
    listed = {key for prefix in FORMAT_AREAS for key in store.list(prefix)}
    lost = {shard: sorted(keys - listed) for shard, keys in named.items()}
    return {shard: keys for shard, keys in lost.items() if keys}
