"""The plan of a plain job, kept next to `_job.json` as one compact Parquet file, so a rerun
(a resume after a driver restart, say) reads it instead of scanning 100M rows again.

`_plan.parquet` holds one row per shard (index, file number, row range, position, buckets as a
bit mask over the job's bucket set, images, id prefix, content digest) and, in its schema
metadata, the plan's fingerprint and the input identities it was made from: about 18 bytes a
shard on disk, a fraction of a second to read for 400,000 shards.

A stored plan is used only when the plan that a scan would make now has the same fingerprint:
the settings of this run and the identity of every input file as listed now (size, rows and
footer sha256, read from the footers alone; the content digests are the stored ones). Anything
else (another shard size, a file added, replaced or gone) plans from scratch, and the new plan
replaces the file. The plan was validated when it was made; a file edited in place under an
unchanged footer is caught by the actors, which digest each shard's rows again before generating.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.driver.input.prompts import InputFile, PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.plan import InputIdentity, JobPlan, PlanConfig, fingerprint_of, settings_doc
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.base import read_each
from ditfleet.workers.storage.input_files import InputFileError, footer_sha256
from ditfleet.workers.storage.parquet_bytes import read_parquet

PLAN_KEY = "_plan.parquet"
PLAN_FILE_VERSION = 2
_META = b"ditfleet.plan"
_ROW_GROUP = 1 << 17

_SCHEMA = pa.schema(
    [
        ("index", pa.int64()),
        ("file", pa.int32()),
        ("row_start", pa.int64()),
        ("row_stop", pa.int64()),
        ("position_start", pa.int64()),
        ("buckets", pa.int64()),  # bit i: bucket i of the job's bucket set
        ("num_images", pa.int64()),
        ("id_prefix", pa.string()),
        ("content_digest", pa.uint64()),  # workers.content_digest over the shard's rows
    ]
)


def plan_table(plan: JobPlan) -> pa.Table:
    """The plan as the table `_plan.parquet` holds (metadata included)."""
    files = {i.uri: n for n, i in enumerate(plan.inputs)}
    bit = {name: 1 << i for i, name in enumerate(plan.config.rows.buckets.names)}
    mask = functools.cache(lambda used: sum(bit[b] for b in used))  # once per bucket combination
    shards = plan.shards
    # Every column but file (a number) and buckets (a mask) is the ShardSpec field of its name.
    columns = {n: [getattr(s, n) for s in shards] for n in _SCHEMA.names if n not in ("file", "buckets")}
    columns["file"] = [files[s.file] for s in shards]
    columns["buckets"] = [mask(s.buckets_used) for s in shards]
    meta = {
        "version": PLAN_FILE_VERSION,
        "fingerprint": plan.fingerprint(),
        "source": plan.source,
        "inputs": [[i.uri, i.size, i.rows, i.footer_sha256, i.content_digest] for i in plan.inputs],
        "total_rows": plan.total_rows,
        "total_images": plan.total_images,
        "buckets_used": list(plan.buckets_used),
        "empty_files": list(plan.empty_files),
        "warnings": list(plan.warnings),
        "sources_per_bucket": {b: [list(s) for s in sizes] for b, sizes in plan.sources_per_bucket.items()},
    }
    return pa.table(columns, schema=_SCHEMA.with_metadata({_META: json.dumps(meta).encode()}))


def save_plan(store: ObjectStore, plan: JobPlan) -> None:
    """Write `_plan.parquet` (replacing one of another plan: it is a cache, `_job.json` and
    the manifests are the record)."""
    sink = io.BytesIO()
    pq.write_table(plan_table(plan), sink, row_group_size=_ROW_GROUP, compression="zstd")
    store.put(PLAN_KEY, sink.getvalue(), content_type="application/vnd.apache.parquet")


def plan_from_table(table: pa.Table, config: PlanConfig) -> JobPlan:
    meta = json.loads(table.schema.metadata[_META])
    inputs = tuple(InputIdentity(*entry) for entry in meta["inputs"])
    uris = [i.uri for i in inputs]
    names = config.rows.buckets.names
    # One tuple per bucket combination, shared by its shards.
    decode = functools.cache(lambda mask: tuple(n for i, n in enumerate(names) if mask >> i & 1))
    cols = {name: table.column(name).to_pylist() for name in _SCHEMA.names}
    shards = tuple(
        ShardSpec(
            index=index,
            file=uris[file],
            row_start=start,
            row_stop=stop,
            position_start=position,
            buckets_used=decode(mask),
            num_images=images,
            id_prefix=prefix,
            content_digest=digest,
        )
        for index, file, start, stop, position, mask, images, prefix, digest in zip(
            *(cols[name] for name in _SCHEMA.names)
        )
    )
    return JobPlan(
        config=config,
        source=meta["source"],
        inputs=inputs,
        shards=shards,
        total_rows=meta["total_rows"],
        total_images=meta["total_images"],
        buckets_used=tuple(meta["buckets_used"]),
        empty_files=tuple(meta["empty_files"]),
        warnings=tuple(meta["warnings"]),
        sources_per_bucket={
            b: tuple((int(w), int(h)) for w, h in sizes)
            for b, sizes in meta.get("sources_per_bucket", {}).items()
        },
    )


def current_identities(source: PromptSource) -> tuple[InputIdentity, ...] | None:
    """The input's identities as listed now, from footers alone; None when a file cannot be
    read (the scan then reports it properly)."""
    files: Sequence[InputFile] = source.files()

    def one(f: InputFile) -> InputIdentity:
        with source.open(f) as pf:
            rows = pf.metadata.num_rows
        return InputIdentity(f.uri, f.size, rows, footer_sha256(source.filesystem, f.uri))

    try:
        return tuple(read_each(one, files))
    except (InputError, InputFileError):
        return None


def load_plan(store: ObjectStore, source: PromptSource, config: PlanConfig) -> JobPlan | None:
    """The stored plan when it is the plan this input and these settings give; else None."""
    if not store.exists(PLAN_KEY):
        return None
    try:
        table = read_parquet(store.get(PLAN_KEY))
        meta = json.loads(table.schema.metadata[_META])
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
        return None  # damaged or foreign: plan from scratch, and the new plan replaces it
    if meta.get("version") != PLAN_FILE_VERSION or not table.schema.remove_metadata().equals(_SCHEMA):
        return None
    inputs = current_identities(source)
    if inputs is None:
        return None
    # Footers alone cannot give the content digests: each listed file whose size, rows and footer
    # are the stored ones takes the stored digest (the actors check each shard's rows against it).
    stored = {tuple(entry[:4]): entry[4] for entry in meta["inputs"]}
    inputs = tuple(
        dataclasses.replace(i, content_digest=stored.get((i.uri, i.size, i.rows, i.footer_sha256)))
        for i in inputs
    )
    doc = {**settings_doc(config), "inputs": [i.to_doc() for i in inputs]}
    if fingerprint_of(doc) != meta.get("fingerprint"):
        return None
    plan = plan_from_table(table, config)
    return plan if plan.fingerprint() == meta["fingerprint"] else None
