"""Which objects of an output its committed manifests account for: the keys a manifest row
may name, the orphans of losing runs (provably another run's, so safe to delete), and the named
objects a listing does not show.

What cannot be accounted for is never deleted: a shard without a readable manifest, or one whose
ok rows name anything but its own attempt objects, has no orphans. Used by `ditfleet verify`
(driver.output.verify), by the driver's finish (driver.output.finish) and by a resume's check
for lost objects (driver.run_job).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq

from ditfleet.workers.output.formats import FORMAT_AREAS, object_key
from ditfleet.workers.output.layout import attempt_object, attempt_prefixes
from ditfleet.workers.output.manifest import current_manifest_key, current_manifest_keys
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import check_key
from ditfleet.workers.storage.local import LocalStore

# Threads reading and deleting objects in a remote store: its calls wait on the network.
IO_THREADS = 16


def io_threads(store: ObjectStore) -> int:
    """Threads for reading a store's objects when the user names none: IO_THREADS for a remote
    store; for a local folder, one per CPU core, since reads there run at CPU speed and more
    threads only contend (1M local objects of 512 B on 2 cores, bench/verify_scan.py: 1 thread
    3,195 objects/s, 2 threads 3,628, 16 threads 3,015)."""
    if isinstance(store, LocalStore):
        return max(1, min(IO_THREADS, os.cpu_count() or 1))
    return IO_THREADS


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


def losing_run_keys(shard: int, tokens: set[str], listed: Iterable[str]) -> list[str]:
    """The keys of `listed` that are attempt objects of `shard` under a token the committed
    manifest does not name (`tokens`: those its ok rows name): provably another run's."""
    return [
        key
        for key in listed
        if (obj := attempt_object(key)) is not None and obj.shard == shard and obj.attempt not in tokens
    ]


def delete_keys(store: ObjectStore, keys: list[str], workers: int = IO_THREADS) -> int:
    """Delete `keys`, a few at a time; returns how many."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(store.delete, keys))
    return len(keys)


def shard_orphans(store: ObjectStore, shard: int, key: str | None = None) -> list[str]:
    """Attempt objects of a committed shard that are provably another run's than the committed
    one: under a token no ok row of its current manifest (`key`, listed when not given) names;
    after a redo, the superseded generations' objects too. [] when the shard has no manifest (its
    runs' objects are still in play then), when the manifest cannot be read, or when one of its
    ok rows names no object of the shard: what cannot be accounted for is never deleted."""
    try:
        key = key or current_manifest_key(store, shard)
        if key is None:
            return []
        table = pq.read_table(io.BytesIO(store.get(key)), columns=["status", "uri"])
    except Exception:  # noqa: BLE001 - absent or unreadable: nothing of the shard is proved an orphan
        return []
    root = store.uri()
    tokens: set[str] = set()
    areas: set[str] = set()
    for status, uri in zip(table.column("status").to_pylist(), table.column("uri").to_pylist()):
        if status != "ok":
            continue
        key, _ = manifest_object_key(root, shard, uri)
        if key is None:
            return []
        tokens.add(attempt_object(key).attempt)  # type: ignore[union-attr]  # checked by manifest_object_key
        areas.add(key.split("/", 1)[0] + "/")
    # One output has one format: list only its area when the manifest names an object there.
    prefixes = [p for p in attempt_prefixes(shard) if not areas or p.split("/", 1)[0] + "/" in areas]
    return losing_run_keys(shard, tokens, (key for prefix in prefixes for key in store.list(prefix)))


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
            table = pq.read_table(io.BytesIO(store.get(key)), columns=["status", "uri"])
        except Exception:  # noqa: BLE001 - an unreadable commit is as bad as a lost object
            named[shard] = {key}
            continue
        keys = set()
        for status, uri in zip(table.column("status").to_pylist(), table.column("uri").to_pylist()):
            if status == "ok":
                keys.add(manifest_object_key(root, shard, uri)[0] or f"{key}: {uri}")
        named[shard] = keys
    listed = {key for prefix in FORMAT_AREAS for key in store.list(prefix)}
    lost = {shard: sorted(keys - listed) for shard, keys in named.items()}
    return {shard: keys for shard, keys in lost.items() if keys}


def clean_orphans(store: ObjectStore, shards: Iterable[int]) -> int:
    """Delete the orphans of the given shards (only committed ones have any); returns how many.
    For the driver that owns the output (its lease), after the fence: stragglers can then only
    add objects no manifest will name, and no redo of these shards is under way."""
    shards = list(shards)
    if not shards:
        return 0
    current = current_manifest_keys(store)  # one listing: each shard's current generation
    shards = [s for s in shards if s in current]
    if not shards:
        return 0
    with ThreadPoolExecutor(max_workers=min(IO_THREADS, len(shards))) as pool:
        orphans = [
            k for keys in pool.map(lambda s: shard_orphans(store, s, current[s]), shards) for k in keys
        ]
    return delete_keys(store, orphans) if orphans else 0
