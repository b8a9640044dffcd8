"""What a finished output must look like to its readers and to INTEGRITY.md, checked from the
outside: by listing and reading the store as a reader that globs the output's folders does.

- `glob_manifest_rows`: the ok rows of every Parquet file directly under manifests/ whose name
  does not start with "_" or "." (what `pyarrow.dataset` over manifests/ and DuckDB's
  `read_parquet('<out>/manifests/*.parquet')` read), each with the key its uri names.
- `data_area_ids`: the ids every object directly in the format's data folder holds
  (`data/*.parquet` rows, `webdataset/*.tar` samples, `images/` files).
- `assert_readers_see_each_row_once`: both of the above give every expected row exactly once,
  and no manifest row names a missing object.
- `manifest_file`: a manifest key's rows and `ditfleet.*` footer metadata (tombstones, seals).
- `assert_superseded` / `assert_sealed` / `assert_success_current`: INTEGRITY.md 3, 4 and 6.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import tarfile
from collections import Counter
from dataclasses import dataclass

from ditfleet.workers.output.formats import object_key
from ditfleet.workers.output.layout import LEASE_PREFIX, lease_key, lease_of_key, manifest_key, success_key
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.parquet_bytes import read_parquet

SUPERSEDED_PREFIX = "_superseded/"
TOMBSTONE = b"ditfleet.tombstone"
SUPERSEDED_BY = b"ditfleet.superseded_by"
AREAS = {"files": "images/", "parquet": "data/", "webdataset": "webdataset/"}


def _visible(key: str, folder: str, suffix: str) -> bool:
    """A key a glob `<folder>*<suffix>` reaches and pyarrow/datasets do not skip."""
    rest = key[len(folder) :]
    return key.startswith(folder) and "/" not in rest and rest.endswith(suffix) and rest[:1] not in ("_", ".")


@dataclass(frozen=True)
class ManifestFile:
    rows: list[dict]
    metadata: dict[bytes, bytes]
    schema_names: list[str]

    @property
    def tombstone(self) -> str | None:
        value = self.metadata.get(TOMBSTONE)
        return value.decode() if value is not None else None


def manifest_file(store: ObjectStore, key: str) -> ManifestFile:
    table = read_parquet(store.get(key))
    return ManifestFile(table.to_pylist(), dict(table.schema.metadata or {}), table.schema.names)


def glob_manifest_rows(store: ObjectStore) -> list[tuple[str, str]]:
    """(id, key its uri names) of each ok row a glob reader of manifests/ sees."""
    root = store.uri()
    rows = []
    for key in sorted(store.list("manifests/")):
        if not _visible(key, "manifests/", ".parquet"):
            continue
        for row in manifest_file(store, key).rows:
            if row["status"] == "ok":
                rows.append((row["id"], object_key(root, row["uri"])[0] or row["uri"]))
    return rows


def data_area_ids(store: ObjectStore, output_format: str) -> list[str]:
    """The ids the objects directly in the data folder hold, one per image, in no order."""
    area = AREAS[output_format]
    ids: list[str] = []
    if output_format == "files":
        for key in store.list(area):
            ids.append(posixpath.basename(key).rsplit(".", 1)[0])
        return ids
    suffix = ".parquet" if output_format == "parquet" else ".tar"
    for key in store.list(area):
        if not _visible(key, area, suffix):
            continue
        data = store.get(key)
        if output_format == "parquet":
            ids += read_parquet(data, ["id"]).column("id").to_pylist()
        else:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                ids += sorted({m.name.split(".", 1)[0] for m in tar.getmembers() if m.isfile()})
    return ids


def reader_problems(store: ObjectStore, expected_ids: list[str], output_format: str) -> list[str]:
    """Everything a glob reader of manifests/ or of the data folder would get wrong: rows seen
    twice or not at all, rows naming an object that is gone."""
    problems = []
    rows = glob_manifest_rows(store)
    seen = Counter(i for i, _ in rows)
    if twice := sorted(i for i, n in seen.items() if n > 1):
        problems.append(f"manifests/ readers see rows {twice} more than once")
    if absent := sorted(set(expected_ids) - set(seen)):
        problems.append(f"manifests/ readers do not see rows {absent}")
    if missing := sorted({key for _, key in rows if not store.exists(key)}):
        problems.append(f"manifests/ rows name objects that are gone: {missing}")
    ids = Counter(data_area_ids(store, output_format))
    if twice := sorted(i for i, n in ids.items() if n > 1):
        problems.append(f"{AREAS[output_format]} readers see rows {twice} more than once")
    if absent := sorted(set(expected_ids) - set(ids)):
        problems.append(f"{AREAS[output_format]} readers do not see rows {absent}")
    if extra := sorted(set(ids) - set(expected_ids)) + sorted(set(seen) - set(expected_ids)):
        problems.append(f"readers see rows that are not the input's: {extra}")
    return problems


def assert_readers_see_each_row_once(store: ObjectStore, expected_ids: list[str], output_format: str) -> None:
    problems = reader_problems(store, expected_ids, output_format)
    assert not problems, "; ".join(problems)


def missing_named(store: ObjectStore, key: str) -> list[str]:
    """The objects the ok rows of manifest `key` name that are gone."""
    root = store.uri()
    named = {object_key(root, r["uri"])[0] for r in manifest_file(store, key).rows if r["status"] == "ok"}
    return sorted(k for k in named if k is None or not store.exists(k))


def assert_superseded(store: ObjectStore, shard: int, generation: int, by: int) -> None:
    """INTEGRITY.md 3: generation `generation` of `shard` was superseded by `by`: its key holds a
    zero-row tombstone with the manifest schema, its manifest and every object it named are kept
    byte for byte under `_superseded/`, and none of those objects is in a reader's folder."""
    key = manifest_key(shard, generation)
    tomb = manifest_file(store, key)
    assert tomb.tombstone == "superseded" and tomb.rows == [], (key, tomb.metadata, len(tomb.rows))
    assert tomb.metadata.get(SUPERSEDED_BY) == str(by).encode(), tomb.metadata
    assert tomb.schema_names == MANIFEST_SCHEMA.names
    old = manifest_file(store, SUPERSEDED_PREFIX + key)
    assert old.tombstone is None and old.rows, f"{SUPERSEDED_PREFIX + key} does not hold the old rows"
    root = store.uri()
    for row in old.rows:
        if row["status"] != "ok":
            continue
        obj = object_key(root, row["uri"])[0]
        assert not store.exists(obj), (
            f"{obj} of superseded generation {generation} is still in a reader's folder"
        )
        kept = store.get(SUPERSEDED_PREFIX + obj)
        if row["sha256"] and not obj.startswith(("data/", "webdataset/")):
            assert hashlib.sha256(kept).hexdigest() == row["sha256"], obj


def assert_sealed(store: ObjectStore, shard: int, generation: int) -> None:
    """INTEGRITY.md 4: the abandoned generation's key holds a zero-row seal."""
    seal = manifest_file(store, manifest_key(shard, generation))
    assert seal.tombstone == "sealed" and seal.rows == [], (seal.metadata, seal.rows)
    assert seal.schema_names == MANIFEST_SCHEMA.names


def lease_generations(store: ObjectStore) -> list[int]:
    return sorted(g for g in map(lease_of_key, store.list(LEASE_PREFIX)) if g is not None)


def assert_success_current(store: ObjectStore) -> None:
    """docs/reliability.md rule 6: `_SUCCESS` is there, and no lease of a higher generation than
    the one that wrote it belongs to a driver (only `ditfleet compact` and `verify --clean`,
    which keep a complete output complete, may have taken the output since)."""
    assert store.exists(success_key()), "no _SUCCESS"
    wrote = json.loads(store.get(success_key())).get("lease")
    later = [g for g in lease_generations(store) if g > wrote]
    drivers = [g for g in later if not json.loads(store.get(lease_key(g))).get("keeps_complete")]
    assert isinstance(wrote, int) and not drivers, (wrote, lease_generations(store), drivers)


def snapshot(store: ObjectStore) -> dict[str, str]:
    """sha256 of every object but the lease documents (coordination, not output)."""
    return {
        key: hashlib.sha256(store.get(key)).hexdigest()
        for key in sorted(store.list(""))
        if not key.startswith(LEASE_PREFIX)
    }
