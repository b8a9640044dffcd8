"""Planning a job: validate the input and cut it into shards, in one pass over the rows.

A shard is a contiguous row range of one input file (ShardSpec); the plan holds shards and
per-file identities, never rows, so its memory is O(shards) (plus 8 bytes per row for the
duplicate-id check while planning). The worker re-reads its shard's rows and resolves them
(workers.rows.resolve_rows); the planner only checks them, against the same bounds.

The plan's fingerprint covers everything that changes the images a row gets (model identity,
sampling defaults, buckets, job seed, shard size) and the identity of every input file (its size,
rows, footer and the digest of its rows' content, workers.content_digest), so an output directory
is never resumed with a different job. Each shard carries its own rows' digest to the actor, which
computes it again over what it reads and refuses rows edited since (workers.rows.read_shard_rows).
Incremental jobs (driver.increment) fingerprint the settings alone and record each run's shards
in the output. The fingerprint is stored, with what it covers, in the output's `_job.json`
(driver.output.job_file).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.compile.buckets import BucketError
from ditfleet.driver.input.arrays import plain
from ditfleet.driver.input.duplicate_ids import DIGEST_BITS
from ditfleet.driver.input.prompts import DEFAULT_BATCH_ROWS, InputFile, PromptSource
from ditfleet.driver.input.row_errors import file_error
from ditfleet.driver.input.scan import ScanOptions, scan_input
from ditfleet.driver.input.validate import DEFAULT_MAX_ERRORS, ValidationReport, valid_sizes
from ditfleet.model.knobs import bounded, check_settings, field_default, setting, settings_fields
from ditfleet.workers.content_digest import IdentityDigest, Prepared, RangeDigest, combine, hex_digest
from ditfleet.workers.rows import MAX_SIDE, RowConfig, ShardSpec, content_columns, source_bucket, with_sources
from ditfleet.workers.sources import SourceHeader, SourceReader, SourceSpecError, column_sources
from ditfleet.workers.storage.base import S3Config, read_each
from ditfleet.workers.storage.input_files import InputFileError, footer_sha256

FINGERPRINT_VERSION = 1
# An edit job's input is read this many rows a batch at most: a batch's source images (embedded
# bytes, header reads) are held together.
EDIT_BATCH_ROWS = 512


@dataclass(frozen=True)
class PlanConfig:
    """How to plan a job.

    rows: how rows resolve (job seed, buckets, sampling defaults, max prompt characters).
    shard_size: input rows per shard (a file's last shard may be shorter; shards never span files).
    image_settings: every other setting that changes pixels, as JSON-safe values (model id and
      revision, dtype, compile mode, ...); it only enters the fingerprint.
    """

    rows: RowConfig = field(default_factory=RowConfig)
    shard_size: int = setting(
        256, ge=1, description="Input rows per shard: the unit of work, retry and commit."
    )
    image_settings: Mapping[str, Any] = field(default_factory=dict)
    max_errors: int = bounded(DEFAULT_MAX_ERRORS, ge=1)
    read_batch_rows: int = bounded(DEFAULT_BATCH_ROWS, ge=1)

    def __post_init__(self) -> None:
        check_settings(self)  # every field's bounds
        if not isinstance(self.shard_size, int):  # a float would cut fractional shards
            raise ValueError(f"PlanConfig.shard_size must be a whole number of rows, got {self.shard_size!r}")
        try:
            json.dumps(dict(self.image_settings), sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"image_settings must hold JSON values (str, number, bool, list, dict): {e}"
            ) from e


@dataclass(frozen=True)
class InputIdentity:
    """What identifies an input file: size, rows and footer from its footer alone, and the digest
    of its rows' content (workers.content_digest.combine of its shards' digests, hex), which
    only a scan of the rows gives; None where unknown (only in identities read from footers)."""

    uri: str
    size: int
    rows: int
    footer_sha256: str
    content_digest: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True)
class JobPlan:
    """The plan: shards over the input files, totals, and the fingerprint of it all."""

    config: PlanConfig
    source: str
    inputs: tuple[InputIdentity, ...]
    shards: tuple[ShardSpec, ...]
    total_rows: int
    total_images: int
    buckets_used: tuple[str, ...]  # in the bucket set's order
    empty_files: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # for the log: nothing wrong with the input, but slow
    images_per_bucket: Mapping[str, int] = field(default_factory=dict)  # in the bucket set's order

    def fingerprint_doc(self) -> dict[str, Any]:
        """The settings and input identities the fingerprint is computed over (stored in _job.json)."""
        return {**settings_doc(self.config), "inputs": [i.to_doc() for i in self.inputs]}

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical JSON of fingerprint_doc()."""
        return fingerprint_of(self.fingerprint_doc())

    @property
    def bucket_usage(self) -> dict[str, int]:
        """Shards per bucket (a shard counts once per bucket it uses)."""
        out = {b: 0 for b in self.buckets_used}
        for s in self.shards:
            for b in s.buckets_used:
                out[b] += 1
        return out


def settings_doc(config: PlanConfig, incremental: bool = False) -> dict[str, Any]:
    """The settings that change the images a row gets, as JSON values.

    A job's fingerprint is this plus its input identities; an incremental job's (whose input
    grows from run to run) is this alone, with "incremental": true and without the shard size
    (each run records its own shards, so a new size changes nothing already made).
    """
    rows = config.rows
    doc: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "image_settings": json.loads(json.dumps(dict(config.image_settings), sort_keys=True)),
        "job_seed": rows.job_seed,
        "steps": rows.steps,
        "true_cfg_scale": rows.true_cfg_scale,
        "negative_prompt": rows.negative_prompt,
        "num_images": rows.num_images,
        "buckets": list(rows.buckets.names),
    }
    for name in ("prompt_column", "id_column"):  # other columns read are other rows
        if getattr(rows, name) != field_default(settings_fields(RowConfig)[name]):
            doc[name] = getattr(rows, name)
    if incremental:
        doc["incremental"] = True
    else:
        doc["shard_size"] = config.shard_size
    return doc


def fingerprint_of(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ShardCutter:
    """Cuts each file into shard_size-row ranges as batches stream by, counting images and buckets.

    Batches of one file come in row order. A batch that does not start where the previous one
    ended (an incremental run leaves out rows its output already has) ends the shard before the
    gap, so a shard is always a contiguous row range. Shards are numbered from first_index;
    id_prefixes (file URI -> prefix) go into the shards of those files (see ShardSpec.id_prefix).
    An edit job's sources are read through `sources` (their headers: workers.sources), their
    identities part of each shard's content digest, their sizes the buckets of rows without one.
    """

    def __init__(
        self,
        config: PlanConfig,
        first_index: int = 0,
        id_prefixes: Mapping[str, str] | None = None,
        sources: SourceReader | None = None,
    ) -> None:
        self.config = config
        self.sources = sources
        if config.rows.image_column is not None and sources is None:
            self.sources = SourceReader(config.rows.source_limits)
        self.buckets = config.rows.buckets
        self.first_index = first_index
        self.id_prefixes = dict(id_prefixes or {})
        self.shards: list[ShardSpec] = []
        self.used: set[int] = set()
        self._file: InputFile | None = None
        self._start = self._position = self._images = 0
        self._rows_in_shard = 0
        self._digest = RangeDigest()
        self._identities = IdentityDigest()
        self._bucket_ids: set[int] = set()
        self._names: dict[frozenset[int], tuple[str, ...]] = {}
        self.bucket_images: Counter[int] = Counter()  # bucket index -> images, over every shard

    def on_batch(self, file: InputFile, first_row: int, first_position: int, batch: pa.RecordBatch) -> None:
        if self._file is not file:
            self.finish_file()
            self._file, self._start, self._position = file, first_row, first_position
        elif first_row != self._start + self._rows_in_shard:  # rows left out before this batch
            if self._rows_in_shard:
                self._emit()
            self._start, self._position = first_row, first_position
        images = self._images_of(batch)
        bucket_ids = self._bucket_ids_of(batch)
        headers = self._source_headers(file, first_row, batch)
        if headers is not None:
            bucket_ids = self._edit_bucket_ids(batch, bucket_ids, headers)
        content = Prepared(batch, content_columns(batch.schema.names))
        single = pc.unique(bucket_ids).to_pylist() if bucket_ids is not None else [0]
        self._count_bucket_images(images, bucket_ids, single, batch.num_rows)
        size, n, at = self.config.shard_size, batch.num_rows, 0
        while at < n:
            row = first_row + at
            take = min(n - at, (row // size + 1) * size - row)
            self._images += (
                (pc.sum(images.slice(at, take)).as_py() or 0)
                if images is not None
                else take * self.config.rows.num_images
            )
            if bucket_ids is None or len(single) == 1:
                self._bucket_ids.add(single[0])
            else:
                self._bucket_ids.update(pc.unique(bucket_ids.slice(at, take)).to_pylist())
            self._digest.add(content, at, at + take)
            for row_headers in headers[at : at + take] if headers is not None else ():
                self._identities.add_row(h.identity for h in row_headers)
            self._rows_in_shard += take
            at += take
            if (first_row + at) % size == 0:
                self._emit()

    def _count_bucket_images(
        self, images: pa.Array | None, bucket_ids: pa.Array | None, single: list[int], rows: int
    ) -> None:
        for bucket in single:
            chosen = None if len(single) == 1 else pc.equal(bucket_ids, bucket)
            if images is None:
                n = rows if chosen is None else pc.sum(chosen).as_py() or 0
                self.bucket_images[bucket] += n * self.config.rows.num_images
            else:
                counts = images if chosen is None else pc.filter(images, chosen)
                self.bucket_images[bucket] += pc.sum(counts).as_py() or 0

    def finish_file(self) -> None:
        if self._rows_in_shard:
            self._emit()
        self._file = None

    def _emit(self) -> None:
        assert self._file is not None
        stop = self._start + self._rows_in_shard
        key = frozenset(self._bucket_ids)
        names = self._names.get(key)
        if names is None:  # one tuple per bucket combination, shared by its shards
            names = self._names[key] = tuple(b.name for i, b in enumerate(self.buckets) if i in key)
        self.shards.append(
            ShardSpec(
                index=self.first_index + len(self.shards),
                file=self._file.uri,
                row_start=self._start,
                row_stop=stop,
                position_start=self._position,
                buckets_used=names,
                num_images=self._images,
                id_prefix=self.id_prefixes.get(self._file.uri),
                content_digest=(
                    self._digest.value()
                    if self.sources is None
                    else with_sources(self._digest.value(), self._identities)
                ),
            )
        )
        self.used |= self._bucket_ids
        self._position += self._rows_in_shard
        self._start, self._images, self._rows_in_shard, self._bucket_ids = stop, 0, 0, set()
        self._digest = RangeDigest()
        self._identities = IdentityDigest()

    def _source_headers(
        self, file: InputFile, first_row: int, batch: pa.RecordBatch
    ) -> list[tuple[SourceHeader, ...]] | None:
        """An edit job's rows' source headers, read side by side (None for a text job). A row
        that names no usable source (a validation error, so no plan) has none."""
        column = self.config.rows.image_column
        if self.sources is None or column is None or column not in batch.schema.names:
            return None
        refs = column_sources(batch.column(column), file.uri, first_row)
        return self.sources.batch_headers([() if isinstance(r, SourceSpecError) else r for r in refs])

    def _edit_bucket_ids(
        self, batch: pa.RecordBatch, sized: pa.Array | None, headers: list[tuple[SourceHeader, ...]]
    ) -> pa.Array:
        """Per row, its bucket's index: a row with a size keeps the one it maps to, the others
        take their first source's (workers.rows.source_bucket, as the worker does)."""
        names = batch.schema.names
        given = (
            pc.and_(pc.is_valid(plain(batch.column("width"))), pc.is_valid(plain(batch.column("height"))))
            if "width" in names and "height" in names
            else None
        )
        has_size = [False] * batch.num_rows if given is None else pc.fill_null(given, False).to_pylist()
        own = [0] * batch.num_rows if sized is None else sized.to_pylist()
        ids = [
            own[i]
            if has_size[i] or not headers[i]
            else self.buckets.index(source_bucket(self.buckets, headers[i][0]))
            for i in range(batch.num_rows)
        ]
        return pa.array(ids, pa.int16())

    def _images_of(self, batch: pa.RecordBatch) -> pa.Array | None:
        if "num_images" not in batch.schema.names or pa.types.is_null(batch.column("num_images").type):
            return None
        # Out-of-range counts are validation errors (and then no plan); safe=False only avoids
        # an overflow exception for them here.
        counts = batch.column("num_images").cast(pa.int64(), safe=False)
        return pc.fill_null(counts, self.config.rows.num_images)

    def _bucket_ids_of(self, batch: pa.RecordBatch) -> pa.Array | None:
        """Per row, the index of its bucket in the bucket set; None when every row uses the default.

        Each distinct (width, height) of the batch is mapped once by BucketSet.map, the same call
        row resolution makes, so the planner and the worker cannot disagree.
        """
        names = batch.schema.names
        if "width" not in names or "height" not in names:
            return None
        w, h = batch.column("width"), batch.column("height")
        if pa.types.is_null(w.type) or pa.types.is_null(h.type):
            return None
        # Rows with invalid sizes are validation errors already; here they get the default bucket.
        _, w, h = valid_sizes(plain(w), plain(h))
        key = pc.add(pc.multiply(w, MAX_SIDE + 1), h)
        distinct = pc.drop_null(pc.unique(key))
        ids = []
        for k in distinct.to_pylist():
            try:
                ids.append(self.buckets.index(self.buckets.map(k // (MAX_SIDE + 1), k % (MAX_SIDE + 1))))
            except BucketError:  # strict mode: reported by validation
                ids.append(0)
        per_row = pc.take(pa.array(ids, pa.int16()), pc.index_in(key, value_set=distinct))
        return pc.fill_null(per_row, 0)


# Files scanned side by side while planning: Parquet decoding and Arrow compute release the GIL,
# so two threads use a small head's two cores.
PLAN_WORKERS = 2


def plan_job(
    source: PromptSource,
    config: PlanConfig,
    workers: int = PLAN_WORKERS,
    digest_bits: int = DIGEST_BITS,
    s3: S3Config | None = None,
) -> JobPlan:
    """Validate every row and plan the shards. Raises InputError (all problems, up to the cap).

    A file that cannot be read, or whose schema is wrong, is reported from the footers alone,
    before any row is read. Files are scanned by `workers` threads, each cut by its own
    ShardCutter: a file's shards are numbered from the shards of the files before it, which
    its footer's row count gives in advance (shards never span files, and a plan has no gaps).
    An edit job's source headers are read through `s3` (the job's S3 settings) for S3 sources.
    """
    cutters: list[ShardCutter] = []
    next_index = 0
    edit = config.rows.image_column is not None
    sources = SourceReader(config.rows.source_limits, s3) if edit else None

    def cutter_for(file: InputFile, first_position: int, rows: int) -> ShardCutter:
        nonlocal next_index
        cutter = ShardCutter(config, first_index=next_index, sources=sources)
        next_index += -(-rows // config.shard_size)
        cutters.append(cutter)
        return cutter

    batch_rows = min(config.read_batch_rows, EDIT_BATCH_ROWS) if edit else config.read_batch_rows
    options = ScanOptions(config.max_errors, batch_rows, workers, True, digest_bits)
    report = scan_input(source, config.rows, options, cutter_for)
    for cutter in cutters:
        cutter.finish_file()
    report.raise_if_errors()
    shards = tuple(s for c in cutters for s in c.shards)
    used = set().union(*(c.used for c in cutters)) if cutters else set()
    rows_per_file: dict[str, int] = {}
    shard_digests: dict[str, list[int]] = {}
    for s in shards:
        rows_per_file[s.file] = rows_per_file.get(s.file, 0) + s.num_rows
        shard_digests.setdefault(s.file, []).append(s.content_digest or 0)
    digest_per_file = {uri: combine(d) for uri, d in shard_digests.items()}
    inputs = input_identities(report, rows_per_file, digest_per_file)
    buckets = config.rows.buckets
    per_bucket: Counter[int] = sum((c.bucket_images for c in cutters), Counter())
    return JobPlan(
        config=config,
        source=source.uri,
        inputs=inputs,
        shards=shards,
        total_rows=report.rows,
        total_images=sum(s.num_images for s in shards),
        buckets_used=tuple(b.name for i, b in enumerate(buckets) if i in used),
        empty_files=report.empty_files,
        warnings=tuple(row_group_warnings(report.largest_row_groups, config.shard_size)),
        images_per_bucket={b.name: per_bucket[i] for i, b in enumerate(buckets) if i in used},
    )


def footer_hashes(source: PromptSource, files: Sequence[InputFile]) -> dict[str, str]:
    """uri -> footer sha256, read in parallel (one or two small reads per file); a file replaced
    or gone since it was listed raises its InputError."""

    def one(f: InputFile) -> str:
        try:
            return footer_sha256(source.filesystem, f.uri)
        except InputFileError as e:
            raise file_error(e.uri, e.problem, e.hint) from e

    return dict(zip((f.uri for f in files), read_each(one, files)))


def input_identities(
    report: ValidationReport, rows_per_file: Mapping[str, int], digest_per_file: Mapping[str, int]
) -> tuple[InputIdentity, ...]:
    """Each file's identity: its size when listed and its footer's sha256 as the pass read it
    (the footer the rows were read with, not read again), with the content digest the pass
    computed. A file replaced later changes its footer, which a resume compares."""
    return tuple(
        InputIdentity(
            f.uri,
            f.size,
            rows_per_file.get(f.uri, 0),
            report.footer_sha256[f.uri],
            hex_digest(digest_per_file.get(f.uri, combine(()))),
        )
        for f in report.files
    )


def idle_actors_warning(shards: int, rows: int, shard_size: int, actors: int) -> str | None:
    """When a plan has fewer shards than the job's actors: those left over get nothing to do (a
    shard runs on one actor). The plan is not adapted to the fleet: the shard size is in the
    fingerprint, so a default that moved with workers.max would make a resume refuse its output."""
    if shards >= actors or rows == 0:
        return None
    fits = max(1, -(-rows // actors))  # rows per shard that gives each actor one
    idle = actors - shards
    return (
        f"{shards} shard{'s' if shards != 1 else ''} for up to {actors} actors: {idle} actor"
        f"{' has' if idle == 1 else 's have'} nothing to run (a shard runs on one actor). shards.size is "
        f"{shard_size} rows; shards.size: {fits} (or less) gives every actor a shard. The size is part of "
        "the plan: an output started with one size resumes only with it"
    )


# A row group this many times a shard makes each actor read and decode up to that many times the
# rows it needs (a shard's rows are read from its row group's start).
ROW_GROUP_WARN_RATIO = 4
ROW_GROUP_WARN_MIN_ROWS = 10_000  # below this a whole row group is read in no time: no warning
_ROW_GROUP_WARN_FILES = 3


def row_group_warnings(largest_row_groups: Mapping[str, int], shard_size: int) -> list[str]:
    """Files whose row groups are large next to the shards: each actor decodes whole stretches of
    a row group it mostly does not need. largest_row_groups: by file, as the scan's footers say
    (ValidationReport.largest_row_groups), in input order."""
    limit = max(ROW_GROUP_WARN_RATIO * shard_size, ROW_GROUP_WARN_MIN_ROWS)
    large = [(uri, rows) for uri, rows in largest_row_groups.items() if rows > limit]
    if not large:
        return []
    shown = ", ".join(f"{uri} ({rows} rows)" for uri, rows in large[:_ROW_GROUP_WARN_FILES])
    more = len(large) - _ROW_GROUP_WARN_FILES
    more_text = f" and {more} more file(s)" if more > 0 else ""
    return [
        f"row groups much larger than a shard ({shard_size} rows) in {shown}{more_text}: an actor reads a "
        "row group from its start up to its shard's last row, so most of what it reads belongs to "
        "other shards. Rewrite the files with smaller row groups, e.g. "
        f"pyarrow.parquet.write_table(table, path, row_group_size={shard_size}), or raise shards.size"
    ]
