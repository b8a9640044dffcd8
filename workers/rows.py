"""Prompt rows: how one input row becomes one generation request, for the planner and the worker.

The driver plans shards as row ranges of the input files and never holds the rows: it checks
them column-wise against the bounds defined here (driver.input.validate). The worker re-reads its
shard's rows and resolves them with `resolve_rows`, where a row's seed and bucket are decided
(its id too; an incremental job's planner applies the same id rule, column-wise, in
driver.increment to skip rows an earlier run covered).

Row resolution (columns of the prompt Parquet; "null" means absent for that row; the prompt and
id columns are `prompt` and `id` unless RowConfig.prompt_column / id_column name others, which
are then read as `prompt` and `id`):
- id: the `id` column (string, or integer in decimal), else the row's global input position
  ("0", "1", ... counted over the files in input order); in an incremental job, whose input
  grows, the file's name and the row instead ("2024-06-01.parquet#17", see ShardSpec.id_prefix),
  which no later file can shift.
- seed: the `seed` column, else derive_seed(job_seed, id): same on any actor, attempt or run.
- width/height: mapped to one of the job's buckets; none given -> the default bucket.
- negative_prompt, steps, true_cfg_scale, num_images: the column, else the job default.
- sources (an edit job, RowConfig.image_column set): that column's source images
  (workers.sources), whose identities the shard's content digest covers; a row without
  width/height gets the bucket nearest its first source's aspect ratio (from its header).
- every other column passes through, converted to JSON-safe values.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from ditfleet.compile.buckets import BucketSet, ResolutionBucket, default_buckets
from ditfleet.model.family import DEFAULT_FAMILY
from ditfleet.model.generation.guidance import DEFAULT_NEGATIVE_PROMPT
from ditfleet.model.knobs import check_settings, setting
from ditfleet.workers.content_digest import IdentityDigest, Prepared, RangeDigest, combine
from ditfleet.workers.sources import (
    SourceHeader,
    SourceLimits,
    SourceReader,
    SourceRef,
    SourceSpecError,
    column_sources,
)
from ditfleet.workers.storage.input_files import InputFileError, open_parquet

# Columns with a meaning; every other column is passed through to the manifest.
KNOWN_COLUMNS = (
    "id", "prompt", "negative_prompt", "seed", "width", "height", "steps", "true_cfg_scale", "num_images"
)  # fmt: skip

# Accepted ranges, inclusive. The validator and RowConfig both check against these.
STEPS_RANGE = (1, 200)
CFG_RANGE = (0.0, 50.0)
NUM_IMAGES_RANGE = (1, 16)
MAX_SEED = 2**63 - 1  # seeds are int64 >= 0
MAX_SIDE = 16384  # pixels; far beyond any bucket, it only guards against nonsense sizes
MAX_SOURCE_MB = 64  # an edit job's source image, as stored (input.max_source_mb)
MAX_SOURCE_MEGAPIXELS = 50  # and decoded (input.max_source_megapixels)

_PANDAS_INDEX = re.compile(r"__index_level_\d+__")
_SEED_PERSON = b"ditfleet-seed"  # blake2b personalisation: these hashes are seeds and nothing else


def derive_seed(job_seed: int, row_id: str) -> int:
    """The seed of a row that gives none: a stable 63-bit hash of (job seed, row id).

    blake2b (digest 8 bytes, person b"ditfleet-seed") over the job seed as 8 big-endian bytes
    followed by the UTF-8 id, read big-endian, top bit cleared -> an int in [0, 2**63). It depends
    on nothing else (no process hash seed, shard, actor, attempt or row order), so it is the same
    on every machine and every run.
    """
    if not 0 <= job_seed <= MAX_SEED:
        raise ValueError(f"job seed must be in [0, 2**63), got {job_seed}")
    h = hashlib.blake2b(
        job_seed.to_bytes(8, "big") + row_id.encode("utf-8"), digest_size=8, person=_SEED_PERSON
    )
    return int.from_bytes(h.digest(), "big") & MAX_SEED


@dataclass(frozen=True)
class RowConfig:
    """What row resolution needs from the job: the seed, the buckets and the sampling defaults."""

    job_seed: int = setting(
        0,
        ge=0,
        le=MAX_SEED,
        description="Job seed: a row without `seed` gets one derived from this and its id.",
    )
    buckets: BucketSet = field(default_factory=lambda: default_buckets(DEFAULT_FAMILY))
    steps: int = setting(
        50, ge=STEPS_RANGE[0], le=STEPS_RANGE[1], description="Denoising steps (a row's `steps` wins)."
    )
    true_cfg_scale: float = setting(
        4.0,
        ge=CFG_RANGE[0],
        le=CFG_RANGE[1],
        description="True CFG scale; > 1 with a negative prompt turns CFG on.",
    )
    negative_prompt: str | None = setting(
        DEFAULT_NEGATIVE_PROMPT, description="Default negative prompt; null: none (CFG off)."
    )
    num_images: int = setting(
        1,
        ge=NUM_IMAGES_RANGE[0],
        le=NUM_IMAGES_RANGE[1],
        description="Images per row (a row's `num_images` wins).",
    )
    max_prompt_chars: int = setting(4000, ge=1, le=10**7, description="Longer prompts are input errors.")
    prompt_column: str = setting(
        "prompt",
        description="The input column that holds the prompts (e.g. 'caption'); the manifests call it 'prompt'.",
    )
    id_column: str = setting(
        "id",
        description="The input column that holds the row ids (e.g. 'key'); the manifests call it 'id'. "
        "A file without it uses row positions as ids, unless this names another column than 'id', "
        "which must then be there.",
    )
    image_column: str | None = setting(
        None,
        fingerprint="when_set",
        description="Set: an edit job. The input column that holds each row's source image(s): a URI "
        "(s3://bucket/key, an absolute path, or a path relative to the input file), a list of them, the "
        "Hugging Face image struct {bytes, path}, or a list of those (several references per row). "
        "The prompt column is then the instruction. Needs an edit model (docs/edit-jobs.md).",
    )
    max_source_mb: int = setting(
        MAX_SOURCE_MB,
        ge=1,
        le=4096,
        fingerprint="when_set",
        description="An edit job's source image larger than this (MiB, as stored) fails its row.",
    )
    max_source_megapixels: int = setting(
        MAX_SOURCE_MEGAPIXELS,
        ge=1,
        le=1000,
        fingerprint="when_set",
        description="An edit job's source image of more pixels than this (millions, decoded) fails its row.",
    )
    # The most source images a row of an edit job may name: the model's (model.family
    # model_max_sources, filled by the job spec like `buckets`; None: any number). Not a setting.
    max_sources: int | None = None

    def __post_init__(self) -> None:
        check_settings(self)
        if not isinstance(self.buckets, BucketSet):
            raise ValueError(f"buckets must be a BucketSet, got {type(self.buckets).__name__}")
        for name in ("prompt_column", "id_column"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must name a column, got {getattr(self, name)!r}")
        if self.prompt_column == self.id_column:
            raise ValueError(f"prompt_column and id_column are both {self.prompt_column!r}: name two columns")
        most = self.max_sources
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 0):
            raise ValueError(f"max_sources must be a count of source images or None, got {most!r}")
        image = self.image_column
        if image is not None and (not isinstance(image, str) or not image):
            raise ValueError(f"image_column must name a column or be null, got {image!r}")
        if image is not None and (image in (self.prompt_column, self.id_column) or image in KNOWN_COLUMNS):
            raise ValueError(
                f"image_column {image!r} is a column the job reads for something else: name the column "
                "that holds the source images"
            )

    @property
    def source_limits(self) -> SourceLimits:
        return SourceLimits(self.max_source_mb * 2**20, self.max_source_megapixels * 10**6)

    @property
    def renamed(self) -> dict[str, str]:
        """Input column -> the name the job knows it by, for the columns named otherwise."""
        return {
            file: known
            for file, known in ((self.prompt_column, "prompt"), (self.id_column, "id"))
            if file != known
        }

    def input_name(self, column: str) -> str:
        """The input's name of the column the job calls `column` (for messages and reads)."""
        return {"prompt": self.prompt_column, "id": self.id_column}.get(column, column)

    def job_names(self, names: list[str]) -> list[str]:
        """An input file's column names as the job knows them: the prompt and id columns renamed,
        and the file's own 'prompt' or 'id' (then not the job's) left out."""
        renamed = self.renamed
        shadowed = set(renamed.values())
        return [renamed.get(n, n) for n in names if n in renamed or n not in shadowed]

    def as_job_columns(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """A batch read from an input file with its columns named as the job knows them."""
        renamed = self.renamed
        if not renamed:
            return batch
        names = batch.schema.names
        keep = [i for i, n in enumerate(names) if n in renamed or n not in set(renamed.values())]
        return pa.RecordBatch.from_arrays(
            [batch.column(i) for i in keep], names=[renamed.get(names[i], names[i]) for i in keep]
        )


@dataclass(frozen=True)
class PromptRow:
    """One input row, resolved: everything needed to generate its images and describe them."""

    id: str
    prompt: str
    negative_prompt: str | None
    seed: int
    width: int  # the bucket's width, pixels: the size actually generated
    height: int
    requested_width: int | None  # the row's own size, if it gave one
    requested_height: int | None
    bucket: str  # "WxH"
    steps: int
    true_cfg_scale: float
    num_images: int
    file: str  # input file URI
    row: int  # 0-based row in that file
    extra: dict[str, Any] = field(default_factory=dict)  # pass-through columns, JSON-safe
    # An edit job's source images, in column order, and what their headers said at the shard
    # (the same as when planned: the content digest holds their identities). () for a text job.
    sources: tuple[SourceRef, ...] = ()
    source_headers: tuple[SourceHeader, ...] = ()

    @property
    def source_problem(self) -> str | None:
        """Why this row's sources cannot be used (the first unusable one's reason), None if they can."""
        return next((h.problem for h in self.source_headers if h.problem is not None), None)


@dataclass(frozen=True)
class ShardSpec:
    """A contiguous range of rows [row_start, row_stop) of one input file: the unit of work."""

    index: int
    file: str  # input file URI (absolute path or s3://bucket/key)
    row_start: int
    row_stop: int
    position_start: int  # global input position of row_start (a row without id uses its position)
    buckets_used: tuple[str, ...]  # bucket names, in the bucket set's order
    num_images: int  # images requested by the rows of this shard
    # Rows without an id column take the id f"{id_prefix}{row}" instead of their position when
    # this is set (incremental jobs: positions shift when a file is added before others).
    id_prefix: str | None = None
    # The manifest generation this run of the shard commits: 0 for its first commit, g >= 1 for
    # a redo of a committed shard (workers.output.layout.manifest_key), which supersedes the
    # lower generations without changing them.
    generation: int = 0
    # The digest of the rows' content when planned (workers.content_digest, over content_columns):
    # the actor computes it again over the rows it reads and refuses to generate when it differs.
    # None: not recorded (a plan made before digests), not checked.
    content_digest: int | None = None

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start


class RowResolutionError(ValueError):
    """A row the worker cannot resolve (the input changed after planning, or was never validated)."""


def to_json_safe(value: Any) -> Any:
    """A pass-through value as JSON-serialisable Python: timestamps/dates -> ISO 8601 strings,
    decimals -> strings (exact), bytes -> base64 strings, nested lists/maps converted inside."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds()}s"
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    return str(value)


def passthrough_columns(names: list[str], image_column: str | None = None) -> list[str]:
    """The columns that pass through to the manifest: all but the known ones, an edit job's
    image column (its manifest columns are source_uris / source_sha256) and pandas' index
    columns ("__index_level_0__", written when a DataFrame with a non-default index is saved)."""
    return [
        n for n in names if n not in KNOWN_COLUMNS and n != image_column and not _PANDAS_INDEX.fullmatch(n)
    ]


def content_columns(names: list[str]) -> list[str]:
    """The columns a job reads, so the ones its content digest covers: the known columns the
    file has and the pass-through ones."""
    return [n for n in names if n in KNOWN_COLUMNS] + passthrough_columns(names)


class InputContentChanged(InputFileError):
    """The rows an actor read for a shard are not the rows that shard was planned with."""


def source_bucket(buckets: BucketSet, header: SourceHeader) -> ResolutionBucket:
    """The bucket of an edit row that gives no size: the one nearest its source's aspect ratio
    (then pixel count), even under strict matching, which is about sizes a row asks for; the
    default bucket when the source's size is unknown (the row fails on it)."""
    if header.width is None or header.height is None:
        return buckets.default()
    return replace(buckets, strict=False).map(header.width, header.height)


def batch_sources(
    batch: pa.RecordBatch, config: RowConfig, file: str, first_row: int
) -> list[tuple[SourceRef, ...]]:
    """Each row's sources from an edit job's batch; RowResolutionError for a row that names
    none (validation refuses those, so only an input changed since reaches this)."""
    assert config.image_column is not None
    out = []
    for i, refs in enumerate(column_sources(batch.column(config.image_column), file, first_row)):
        if isinstance(refs, SourceSpecError):
            raise RowResolutionError(f"{file}: row {first_row + i}, column {config.image_column!r}: {refs}")
        out.append(refs)
    return out


def with_sources(rows_digest: int, identities: IdentityDigest) -> int:
    """An edit shard's content digest: its rows' and its sources' identities together."""
    return combine([rows_digest, identities.value()])


def check_content(shard: ShardSpec, found: int, sources: bool = False) -> None:
    """Refuse (InputContentChanged) rows whose digest is not the planned one; sources: an edit
    shard's digest, which covers its rows' source images too."""
    if shard.content_digest is None or found == shard.content_digest:
        return
    what = (
        "their content digest differs"
        if not sources
        else "the digest of their content or their source images differs"
    )
    raise InputContentChanged(
        shard.file,
        f"rows {shard.row_start}..{shard.row_stop - 1} (shard {shard.index}) changed since the output was "
        f"planned ({what})",
        "Point the job at a new output, or restore the file" + (" and its sources" if sources else ""),
    )


def _row_id(value: Any, file: str, row: int) -> str:
    if value is None:
        raise RowResolutionError(
            f"{file}: row {row}, column 'id': id is null. Give every row an id, or drop the column"
        )
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowResolutionError(f"{file}: row {row}, column 'id': id {value!r} is not a string or integer")
    return str(value)


def _bucket_of(
    w: int | None,
    h: int | None,
    config: RowConfig,
    mapped: dict[tuple[int, int], ResolutionBucket],
    where: str,
) -> ResolutionBucket:
    """The bucket of a requested size (the default bucket without one); `mapped` memoises sizes."""
    if w is None and h is None:
        return config.buckets.default()
    if w is None or h is None:
        raise RowResolutionError(f"{where}, columns 'width'/'height': only one of them given ({w}, {h})")
    if (w, h) not in mapped:
        mapped[w, h] = config.buckets.map(w, h)
    return mapped[w, h]


# Columns a row may leave null for the job's default (RowConfig's field of the same name), and
# how a given value is read.
_DEFAULTED: dict[str, Callable[[Any], Any]] = {
    "negative_prompt": lambda value: value,
    "steps": int,
    "true_cfg_scale": float,
    "num_images": int,
}


def resolve_rows(
    batch: pa.RecordBatch,
    config: RowConfig,
    shard: ShardSpec,
    first_row: int,
    sources: Sequence[tuple[tuple[SourceRef, ...], tuple[SourceHeader, ...]]] | None = None,
) -> list[PromptRow]:
    """Resolve the rows of `batch` (rows first_row.. of the shard's file) into PromptRows.

    Rows without an id use their global input position as id, or f"{id_prefix}{row}" when the
    shard has an id_prefix. sources: an edit job's, per row (refs and headers, read_shard_rows).
    """
    n, names, file = batch.num_rows, batch.schema.names, shard.file
    known = {name: batch.column(name).to_pylist() if name in names else [None] * n for name in KNOWN_COLUMNS}
    extras = {
        name: batch.column(name).to_pylist() for name in passthrough_columns(names, config.image_column)
    }
    position = shard.position_start + first_row - shard.row_start
    mapped: dict[tuple[int, int], ResolutionBucket] = {}
    out: list[PromptRow] = []
    for i in range(n):
        row = first_row + i
        prompt, seed = known["prompt"][i], known["seed"][i]
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowResolutionError(
                f"{file}: row {row}, column 'prompt': no prompt ({prompt!r}). Run the input through validation"
            )
        if "id" in names:
            row_id = _row_id(known["id"][i], file, row)
        else:
            row_id = f"{shard.id_prefix}{row}" if shard.id_prefix is not None else str(position + i)
        w, h = known["width"][i], known["height"][i]
        refs, headers = sources[i] if sources is not None else ((), ())
        if w is None and h is None and headers:
            bucket = source_bucket(config.buckets, headers[0])
        else:
            bucket = _bucket_of(w, h, config, mapped, f"{file}: row {row}")
        out.append(
            PromptRow(
                id=row_id,
                prompt=prompt,
                seed=derive_seed(config.job_seed, row_id) if seed is None else int(seed),
                width=bucket.width,
                height=bucket.height,
                requested_width=w,
                requested_height=h,
                bucket=bucket.name,
                file=file,
                row=row,
                extra={name: to_json_safe(values[i]) for name, values in extras.items()},
                sources=refs,
                source_headers=headers,
                **{
                    k: getattr(config, k) if known[k][i] is None else read(known[k][i])
                    for k, read in _DEFAULTED.items()
                },
            )
        )
    return out


def read_shard_rows(
    shard: ShardSpec,
    filesystem: pafs.FileSystem,
    config: RowConfig,
    batch_rows: int = 4096,
    sources: SourceReader | None = None,
) -> list[PromptRow]:
    """Read and resolve the rows of one shard: only the row groups that overlap it are read, and
    of those only up to the shard's last row (streamed: nothing after it is fetched or decoded;
    rows before its first are decoded, as Parquet pages are, but never turned into rows).

    An edit job's sources are located and their headers read here (through `sources`, one
    reader per actor; a default one otherwise), their identities part of the content digest.

    Raises InputFileError if the file no longer holds the planned rows or images, and
    InputContentChanged if their content digest is not the planned one (it changed after planning).
    """
    with open_parquet(filesystem, shard.file, stream=True) as pf:
        meta = pf.metadata
        if meta.num_rows < shard.row_stop:
            raise InputFileError(
                shard.file,
                f"has {meta.num_rows} rows, but shard {shard.index} was planned for rows "
                f"{shard.row_start}..{shard.row_stop - 1}",
                "The input changed after the job was planned; start a new job (new output) for the new input",
            )
        groups, first_group_row, start = [], None, 0
        for g in range(meta.num_row_groups):
            size = meta.row_group(g).num_rows
            if start < shard.row_stop and start + size > shard.row_start:
                groups.append(g)
                first_group_row = start if first_group_row is None else first_group_row
            start += size
        parts: list[tuple[int, pa.RecordBatch]] = []
        at = first_group_row or 0
        batch_rows = max(1, min(batch_rows, shard.num_rows))  # no batch reaches far past the shard
        for read in pf.iter_batches(batch_size=batch_rows, row_groups=groups):
            batch = config.as_job_columns(read)
            lo, hi = max(shard.row_start - at, 0), min(shard.row_stop - at, batch.num_rows)
            if hi > lo:
                parts.append((at + lo, batch.slice(lo, hi - lo)))
            at += batch.num_rows
            if at >= shard.row_stop:
                break
    # The content first: an edited row is refused as such, before anything reads its values.
    whole = sum(p.num_rows for _, p in parts) == shard.num_rows and bool(parts)
    found: int | None = None
    if whole:
        columns = content_columns(parts[0][1].schema.names)
        digest = RangeDigest()
        for _, part in parts:
            digest.add(Prepared(part, columns), 0, part.num_rows)
        found = digest.value()
        if config.image_column is None:
            check_content(shard, found)
    per_part: list[list[tuple[tuple[SourceRef, ...], tuple[SourceHeader, ...]]] | None] = [None] * len(parts)
    if config.image_column is not None and whole:
        reader = sources or SourceReader(config.source_limits)
        identities = IdentityDigest()
        for p, (first, part) in enumerate(parts):
            try:
                refs = batch_sources(part, config, shard.file, first)
            except RowResolutionError:
                # A row that names no source was refused when planned: the rows changed since.
                check_content(shard, found or 0, sources=True)
                raise
            headers = reader.batch_headers(refs)
            for row_headers in headers:
                identities.add_row(h.identity for h in row_headers)
            per_part[p] = list(zip(refs, headers))
        check_content(shard, with_sources(found or 0, identities), sources=True)
    rows: list[PromptRow] = []
    for (first, part), part_sources in zip(parts, per_part):
        rows += resolve_rows(part, config, shard, first, part_sources)
    images = sum(r.num_images for r in rows)
    if len(rows) != shard.num_rows or images != shard.num_images:
        raise InputFileError(
            shard.file,
            f"rows {shard.row_start}..{shard.row_stop - 1} now ask for {images} images in {len(rows)} rows; "
            f"shard {shard.index} was planned for {shard.num_images} images in {shard.num_rows} rows",
            "The input changed after the job was planned; start a new job (new output) for the new input",
        )
    return rows
