"""The shard manifest: one row per requested image (failures included), one schema, defined once.

A shard's manifest is written last, create-only; its existence is the shard's commit.

A manifest key, once written, is never freed. Two zero-row files with exactly MANIFEST_SCHEMA
may occupy one instead of rows (a reader of the union reads nothing from them):
- a tombstone (`ditfleet.tombstone = superseded`, `ditfleet.superseded_by = g`,
  `ditfleet.superseded_objects` = the JSON list of the object keys its ok rows named): the
  generation was superseded by a redo's generation g; its rows are kept whole under
  `_superseded/` (driver.output.supersede), but nothing needs that copy: the tombstone alone says
  which objects were the generation's, so deleting `_superseded/` loses only history;
- a seal (`ditfleet.tombstone = sealed`), only at a redo key: the generation was abandoned
  before it committed; no straggler of it can ever commit.
`MANIFEST_SCHEMA` is derived from `ManifestRow`, so the row type and the Parquet schema cannot
drift apart. Every shard writes exactly this schema, so the union of all manifests reads as one
table with pyarrow.dataset, pandas, DuckDB and Hugging Face datasets.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import io
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.model.quality.table import SCORER_NAMES, SCORERS
from ditfleet.workers.output.layout import (
    MANIFESTS_PREFIX,
    manifest_key,
    manifest_of_key,
    manifest_prefix,
)
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.parquet_bytes import read_parquet

MANIFEST_VERSION = "1"
STATUSES = ("ok", "failed")
# A list of strings as Parquet stores it: its element field is named "element" (the Parquet
# spec's), so a manifest read back has exactly the schema it was written with.
_STRINGS = pa.list_(pa.field("element", pa.string()))

# What occupies a manifest key (manifest_kind): rows, or one of the two zero-row markers.
MANIFEST = "manifest"
SUPERSEDED = "superseded"
SEALED = "sealed"
_TOMBSTONE_KEY = b"ditfleet.tombstone"
_SUPERSEDED_BY_KEY = b"ditfleet.superseded_by"
_SUPERSEDED_OBJECTS_KEY = b"ditfleet.superseded_objects"


def _col(arrow_type: pa.DataType, doc: str, default: Any = dataclasses.MISSING) -> Any:
    """A column; the ones that default to None, and only those, are nullable."""
    return field(default=default, metadata={"arrow": arrow_type, "nullable": default is None, "doc": doc})


@dataclass(frozen=True, kw_only=True)
class ManifestRow:
    """One requested image. Sizes in pixels, times in seconds, `bytes` in bytes."""

    id: str = _col(pa.string(), "input row id (the input's id column, as text)")
    k: int = _col(pa.int32(), "index of this image among its row's num_images")
    prompt: str = _col(pa.string(), "prompt as given")
    negative_prompt: str | None = _col(pa.string(), "negative prompt; null = none", None)
    seed: int = _col(pa.int64(), "seed of this row (image k uses seed and k)")
    width: int = _col(pa.int32(), "generated width (the bucket's), pixels")
    height: int = _col(pa.int32(), "generated height (the bucket's), pixels")
    bucket: str = _col(pa.string(), "resolution bucket, 'WxH'")
    steps: int = _col(pa.int32(), "denoising steps")
    true_cfg_scale: float = _col(pa.float64(), "true classifier-free guidance scale")
    model_id: str = _col(pa.string(), "model that generated the image")
    model_revision: str | None = _col(pa.string(), "model revision or weights hash", None)
    status: str = _col(pa.string(), "'ok' or 'failed'")
    error: str | None = _col(pa.string(), "why the image failed; null when ok", None)
    uri: str | None = _col(pa.string(), "where the image is (the data file in 'parquet' format)", None)
    sha256: str | None = _col(pa.string(), "sha256 (hex) of the encoded image bytes", None)
    bytes: int | None = _col(pa.int64(), "size of the encoded image", None)
    format: str = _col(pa.string(), "image format: png, webp or jpeg")
    generate_s: float | None = _col(pa.float64(), "this image's share of its batch's generation time", None)
    encode_s: float | None = _col(pa.float64(), "image encode time", None)
    upload_s: float | None = _col(pa.float64(), "upload time (null in 'parquet' format)", None)
    worker: str = _col(pa.string(), "worker that made the image (node and actor)")
    attempt: int = _col(pa.int32(), "attempt of the shard, from 0")
    shard: int = _col(pa.int32(), "shard index")
    compile_fallback: bool = _col(pa.bool_(), "a compile failed and this image ran eager", False)
    recompiles: int = _col(pa.int32(), "compilations on the request path during this shard (should be 0)", 0)
    # Pass-through input columns as one JSON object per row. Typed columns would take their
    # types from each shard's values: a column that is all-null in one shard (null type), int in
    # one and float in another, or a nested value, gives shards with different schemas, which
    # readers of the union refuse or silently coerce. One JSON text column has the same type in
    # every shard; DuckDB (json_extract), pandas (json.loads) and datasets read it as is.
    extra: str | None = _col(pa.string(), "pass-through input columns, a JSON object; null = none", None)
    # The step cache (sampling.step_cache); null when it is off, and in manifests written before
    # it existed (read_manifests fills these columns with nulls for them).
    step_cache: str | None = _col(
        pa.string(),
        "step-cache settings as JSON, or 'off (why)' when the schedule ran exact; null = off",
        None,
    )
    dit_blocks_computed: int | None = _col(
        pa.int64(), "DiT block evaluations computed for this image (CFG branches summed)", None
    )
    dit_blocks_reused: int | None = _col(
        pa.int64(), "DiT block evaluations the step cache reused instead", None
    )
    # The batch size the image's actor ran with (workers.batch_fit: its GPU's largest, at most
    # workers.batch_size): batched kernels round differently, so a mixed fleet's images of one
    # seed agree with a single-size fleet's only to rounding level. Null in older manifests.
    batch_size: int | None = _col(
        pa.int32(), "images per batch of the actor that made this image (its GPU's fit)", None
    )
    # The scores of workers.scorers, by scorer name: one column score_{name} per scorer of
    # model.quality.table, in its order, taken on the actor from the stored pixels; null when the job
    # did not ask for that scorer, when the image failed, or when the scorer cannot judge it (tiny
    # off its caption template).
    scores: Mapping[str, float | None] = field(default_factory=dict, metadata={"scores": True})
    # quality.gate (workers.quality_gate); null without a gate. The tries' scores and seeds are
    # JSON lists in try order (a null score: that try failed or could not be judged), text rather
    # than list columns so every reader and the compacted set's digests take them as they are;
    # `seed` above stays the row's, gate_seeds[gate_kept] is the seed the stored image was made with.
    gate_passed: bool | None = _col(
        pa.bool_(),
        "the kept try scored at least quality.gate.min; null: no gate, or not judgeable",
        None,
    )
    gate_tries: int | None = _col(pa.int32(), "tries made of this image (quality.gate)", None)
    gate_kept: int | None = _col(pa.int32(), "index of the kept try (from 0)", None)
    gate_scores: str | None = _col(pa.string(), "the gate scorer's score of every try, a JSON list", None)
    gate_seeds: str | None = _col(pa.string(), "the seed of every try, a JSON list", None)
    # The stored image's 64-bit perceptual hash (model.quality.perceptual_hash), always taken on the
    # actor; its 64 bits as a signed int64 (bit 63 is the sign), since not every reader has uint64.
    # Hamming distance: bit_count(a XOR b) in DuckDB, np.bitwise_count in numpy. Null when the image
    # failed, and in older manifests.
    phash: int | None = _col(
        pa.int64(), "64-bit perceptual hash of the stored image, as int64 (near duplicates)", None
    )
    # The licence the model is used under (model.license, else its model card's: workers.weights.
    # licence), so a row says what its image may be used for wherever it is copied; null when not
    # known, and in older manifests.
    model_license: str | None = _col(
        pa.string(),
        "licence id of the model that generated the image (e.g. apache-2.0); null = not known",
        None,
    )
    # An edit job's source images (input.image_column), in the row's column order, so a dataset
    # joins back to what it was made from (unnest both lists in DuckDB; docs/reliability.md). An
    # embedded source (the datasets image struct) is named by its struct `path`, else by
    # `<input file uri>#row=<n>&image=<i>`. A sha256 is null where that source could not be read
    # (the row then failed; `error` says why). Both null for text-to-image rows and older manifests.
    source_uris: tuple[str, ...] | None = _col(
        _STRINGS,
        "edit jobs: the row's source images by URI, in column order; null = text job",
        None,
    )
    source_sha256: tuple[str | None, ...] | None = _col(
        _STRINGS,
        "edit jobs: sha256 (hex) of each source's bytes, as source_uris; null element = unreadable",
        None,
    )

    def __post_init__(self) -> None:
        if isinstance(self.extra, Mapping):
            object.__setattr__(self, "extra", passthrough_json(self.extra))
        for name in ("source_uris", "source_sha256"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = _source_problems(self.status, self.source_uris, self.source_sha256)
        if self.status not in STATUSES:
            problems.append(f"status {self.status!r} is not one of {STATUSES}")
        elif self.status == "ok" and (self.uri is None or self.sha256 is None or self.bytes is None):
            problems.append("an ok row needs uri, sha256 and bytes")
        elif self.status == "failed" and not self.error:
            problems.append("a failed row needs an error message")
        problems += _score_problems(self.scores)
        for f in dataclasses.fields(self):
            if f.metadata.get("scores"):
                continue
            value = getattr(self, f.name)
            if value is None:
                if not f.metadata["nullable"]:
                    problems.append(f"{f.name} may not be null")
                continue
            kind = f.metadata["arrow"]
            if pa.types.is_integer(kind) and (isinstance(value, bool) or not isinstance(value, int)):
                problems.append(f"{f.name} must be an int, got {value!r}")
            elif pa.types.is_floating(kind) and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                problems.append(f"{f.name} must be a number, got {value!r}")
            elif pa.types.is_string(kind) and not isinstance(value, str):
                problems.append(f"{f.name} must be a str, got {type(value).__name__}")
            elif pa.types.is_boolean(kind) and not isinstance(value, bool):
                problems.append(f"{f.name} must be a bool, got {value!r}")
            elif pa.types.is_list(kind) and not (
                isinstance(value, tuple) and all(v is None or isinstance(v, str) for v in value)
            ):
                problems.append(f"{f.name} must be a list of str, got {value!r}")
        if problems:
            raise ValueError(f"manifest row id={self.id!r} k={self.k!r}: " + "; ".join(problems))


def _source_problems(status: str, uris: Any, digests: Any) -> list[str]:
    """The two source columns agree: both null (a text job) or one digest per URI, and an ok
    row's every source was read (an image cannot have been made from a source nobody read)."""
    if (uris is None) != (digests is None):
        return ["source_uris and source_sha256 are both null (a text job) or both set (an edit job)"]
    if uris is None or not isinstance(uris, tuple) or not isinstance(digests, tuple):
        return []  # the type check below names a non-list
    problems = []
    if None in uris:
        problems.append("source_uris may not hold a null (every source has a URI)")
    if len(uris) != len(digests):
        problems.append(f"{len(uris)} source_uris but {len(digests)} source_sha256 (one per source)")
    elif status == "ok" and None in digests:
        problems.append("an ok row needs every source's sha256 (a null one: that source was not read)")
    return problems


def _score_problems(scores: Mapping[str, Any]) -> list[str]:
    problems = [
        f"scores: {name!r} is no scorer of model.quality.table" for name in scores if name not in SCORER_NAMES
    ]
    return problems + [
        f"score_{name} must be a number, got {v!r}"
        for name, v in scores.items()
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))
    ]


def _columns() -> list[tuple[str, pa.DataType, bool, str, Any]]:
    """(name, type, nullable, doc, value of a row) of every manifest column, in order: a field of
    ManifestRow each, and its `scores` one score_{name} per scorer of the table."""
    out: list[tuple[str, pa.DataType, bool, str, Any]] = []
    for f in dataclasses.fields(ManifestRow):
        if f.metadata.get("scores"):
            out += [
                (s.manifest_column, pa.float64(), True, s.column_doc, lambda r, n=s.name: r.scores.get(n))
                for s in SCORERS
            ]
        else:
            out.append(
                (
                    f.name,
                    f.metadata["arrow"],
                    f.metadata["nullable"],
                    f.metadata["doc"],
                    lambda r, n=f.name: getattr(r, n),
                )
            )
    return out


_COLUMNS = _columns()
MANIFEST_SCHEMA = pa.schema(
    [
        pa.field(name, kind, nullable=nullable, metadata={"doc": doc})
        for name, kind, nullable, doc, _ in _COLUMNS
    ],
    metadata={"ditfleet.manifest_version": MANIFEST_VERSION},
)


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays
        return value.tolist()
    raise TypeError(f"pass-through value of type {type(value).__name__} has no JSON form: {value!r}")


def _finite(value: Any) -> Any:
    # JSON has no NaN/Infinity (DuckDB and strict parsers reject them): keep them as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def passthrough_json(values: Mapping[str, Any]) -> str | None:
    """Encode pass-through input columns as compact JSON (input column order kept).

    Dates and times become ISO strings, Decimals strings, binary base64, NaN/Infinity strings.
    An empty mapping is null.
    """
    if not values:
        return None
    return json.dumps(_finite(dict(values)), default=_json_default, ensure_ascii=False, separators=(",", ":"))


def manifest_table(rows: list[ManifestRow]) -> pa.Table:
    """Rows -> a table with exactly MANIFEST_SCHEMA (also when every value of a column is null)."""
    columns = {name: [value(r) for r in rows] for name, _, _, _, value in _COLUMNS}
    return pa.Table.from_pydict(columns, schema=MANIFEST_SCHEMA)


def manifest_bytes(rows: list[ManifestRow]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(manifest_table(rows), buf, compression="zstd")
    return buf.getvalue()


class ManifestWriter:
    """Collects the rows of one shard and commits them as the shard's manifest."""

    def __init__(self, shard: int, expected_rows: int | None = None, generation: int = 0) -> None:
        self.shard = shard
        self.expected_rows = expected_rows
        self.key = manifest_key(shard, generation)
        self._rows: list[ManifestRow] = []
        self._seen: set[tuple[str, int]] = set()

    def add(self, row: ManifestRow) -> None:
        if row.shard != self.shard:
            raise ValueError(f"row id={row.id!r} k={row.k} belongs to shard {row.shard}, not {self.shard}")
        if (row.id, row.k) in self._seen:
            raise ValueError(f"shard {self.shard}: row id={row.id!r} k={row.k} added twice")
        self._seen.add((row.id, row.k))
        self._rows.append(row)

    def __len__(self) -> int:
        return len(self._rows)

    def commit(self, store: ObjectStore) -> bool:
        """Write the manifest create-only. True: this shard is committed with these rows.
        False: another attempt committed it first; discard this attempt's work."""
        if not self._rows:
            raise ValueError(f"shard {self.shard}: refusing to commit a manifest without rows")
        if self.expected_rows is not None and len(self._rows) != self.expected_rows:
            raise ValueError(
                f"shard {self.shard}: {len(self._rows)} manifest rows, expected {self.expected_rows} "
                "(every requested image needs exactly one row, failures included)"
            )
        # Rows stay in the order they were added (the plan's order), so reruns write the same rows.
        return store.put_if_absent(self.key, manifest_bytes(self._rows), "application/vnd.apache.parquet")


def _marker_bytes(metadata: dict[bytes, bytes]) -> bytes:
    buf = io.BytesIO()
    schema = MANIFEST_SCHEMA.with_metadata({**MANIFEST_SCHEMA.metadata, **metadata})
    pq.write_table(schema.empty_table(), buf, compression="zstd")
    return buf.getvalue()


def tombstone_bytes(superseded_by: int, objects: Iterable[str]) -> bytes:
    """The tombstone written over a superseded generation's manifest key: zero rows, exactly
    MANIFEST_SCHEMA, saying which generation superseded it and which object keys the
    generation's ok rows named (so no rule needs its copy under `_superseded/`). Deterministic
    bytes, so two supersessions of one generation write the same object."""
    if isinstance(superseded_by, bool) or not isinstance(superseded_by, int) or superseded_by < 1:
        raise ValueError(f"a superseding generation is an int >= 1, got {superseded_by!r}")
    return _marker_bytes(
        {
            _TOMBSTONE_KEY: SUPERSEDED.encode(),
            _SUPERSEDED_BY_KEY: str(superseded_by).encode(),
            _SUPERSEDED_OBJECTS_KEY: json.dumps(sorted(set(objects))).encode(),
        }
    )


def seal_bytes() -> bytes:
    """The seal written create-only at an abandoned redo generation's manifest key."""
    return _marker_bytes({_TOMBSTONE_KEY: SEALED.encode()})


@dataclass(frozen=True)
class ManifestKind:
    """What occupies a manifest key: MANIFEST (rows), SUPERSEDED (a tombstone, with the
    generation that superseded it and the object keys its rows named) or SEALED."""

    kind: str
    superseded_by: int | None = None
    # A tombstone's object keys; None when it was written before they were recorded (its
    # rows are then known only from its copy under `_superseded/`).
    objects: tuple[str, ...] | None = None


def manifest_kind(data: bytes) -> ManifestKind:
    """Read a manifest key's footer (its schema metadata) alone; raises on what is not Parquet."""
    metadata = pq.read_schema(pa.BufferReader(data)).metadata or {}
    marker = metadata.get(_TOMBSTONE_KEY)
    if marker == SEALED.encode():
        return ManifestKind(SEALED)
    if marker == SUPERSEDED.encode():
        by = metadata.get(_SUPERSEDED_BY_KEY, b"")
        objects = metadata.get(_SUPERSEDED_OBJECTS_KEY)
        keys = None if objects is None else json.loads(objects)
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise ValueError(f"a tombstone's {_SUPERSEDED_OBJECTS_KEY.decode()} is not a list of keys")
        return ManifestKind(
            SUPERSEDED, int(by) if by.isdigit() else None, None if keys is None else tuple(keys)
        )
    return ManifestKind(MANIFEST)


def manifest_generations(keys) -> dict[int, dict[int, str]]:
    """Shard -> {generation: key} of the manifest keys among `keys` (a listing of manifests/)."""
    found: dict[int, dict[int, str]] = {}
    for key in keys:
        parsed = manifest_of_key(key)
        if parsed is not None:
            found.setdefault(parsed[0], {})[parsed[1]] = key
    return found


def current_of(store: ObjectStore, generations: dict[int, str]) -> str | None:
    """The highest generation that is not a seal. A seal can only be at a redo key, so only a
    shard's redo keys are opened, highest first, and only until one is not a seal."""
    for generation in sorted(generations, reverse=True):
        key = generations[generation]
        if generation == 0:
            return key
        try:
            if manifest_kind(store.get(key)).kind != SEALED:
                return key
        except Exception:  # noqa: BLE001 - unreadable: not a seal we wrote; readers report it
            return key
    return None


def _current(store: ObjectStore, keys) -> dict[int, str]:
    found = {shard: current_of(store, g) for shard, g in manifest_generations(keys).items()}
    return {shard: key for shard, key in found.items() if key is not None}


def current_manifest_keys(store: ObjectStore) -> dict[int, str]:
    """Shard -> the key of its current manifest: its highest generation that is not a seal (a
    redo's, else the first commit's). Superseded generations are tombstones with their rows under
    `_superseded/`; an abandoned redo's key holds a seal."""
    return _current(store, store.list(MANIFESTS_PREFIX))


def current_manifest_key(store: ObjectStore, shard: int) -> str | None:
    """The current manifest of one shard (a listing of its own manifests), None if uncommitted."""
    return _current(store, store.list(manifest_prefix(shard))).get(shard)


def committed_shards(store: ObjectStore) -> set[int]:
    """Shards with a manifest that is not a seal, of any generation (the resume set)."""
    return set(current_manifest_keys(store))


def with_later_columns(table: pa.Table) -> pa.Table:
    """A manifest written before nullable columns were added at the end of the schema, with those
    columns as nulls: older outputs stay readable (resume, verify, report) as one table."""
    names = table.schema.names
    if names != MANIFEST_SCHEMA.names[: len(names)]:
        return table
    for f in list(MANIFEST_SCHEMA)[len(names) :]:
        if not f.nullable:
            return table
        table = table.append_column(f, pa.nulls(table.num_rows, type=f.type))
    return table


def read_manifests(store: ObjectStore) -> pa.Table:
    """Every shard's current manifest as one table (MANIFEST_SCHEMA), ordered by shard."""
    tables = []
    current = current_manifest_keys(store)
    for shard in sorted(current):
        key = current[shard]
        table = with_later_columns(read_parquet(store.get(key)))
        if not table.schema.equals(MANIFEST_SCHEMA, check_metadata=False):
            raise ValueError(
                f"{store.uri(key)} does not have the manifest schema (version {MANIFEST_VERSION}); "
                f"it has {table.schema}. Was it written by another version of ditfleet?"
            )
        tables.append(table.replace_schema_metadata(MANIFEST_SCHEMA.metadata))
    if not tables:
        return MANIFEST_SCHEMA.empty_table()
    return pa.concat_tables(tables)
