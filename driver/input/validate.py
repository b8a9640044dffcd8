"""The checks of every input row, before any GPU is touched (driver/input/scan.py reads the rows).

Checks run column-wise with pyarrow compute on each read batch, so a million rows take seconds.
Only the first `max_errors` problems are kept (with file, row, column and value); all are counted.
A column of the wrong type is one schema-level problem for its file, not one per row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.driver.input.arrays import outside, plain
from ditfleet.driver.input.prompts import InputFile
from ditfleet.driver.input.row_errors import InputError, RowError, describe_value
from ditfleet.workers.rows import CFG_RANGE, MAX_SEED, MAX_SIDE, NUM_IMAGES_RANGE, STEPS_RANGE, RowConfig
from ditfleet.workers.sources import SourceSpecError, column_problem, column_sources

DEFAULT_MAX_ERRORS = 50

_INTEGER = (frozenset({"integer", "null"}), "integer (int64)")
# Column -> (accepted kinds, how to say it). "null": a column of nothing but nulls.
_EXPECTED: dict[str, tuple[frozenset[str], str]] = {
    "prompt": (frozenset({"string"}), "string"),
    "id": (frozenset({"string", "integer", "null"}), "string or integer"),
    "negative_prompt": (frozenset({"string", "null"}), "string"),
    "true_cfg_scale": (frozenset({"float", "integer", "null"}), "float"),
    **{c: _INTEGER for c in ("seed", "width", "height", "steps", "num_images")},
}
# Inclusive ranges of the numeric columns.
_RANGES: dict[str, tuple[float, float]] = {
    "seed": (0, MAX_SEED),
    "steps": STEPS_RANGE,
    "true_cfg_scale": CFG_RANGE,
    "num_images": NUM_IMAGES_RANGE,
}
_GIVE_PROMPT = "Give every row a prompt, or drop the row"
_SHORTEN = "Shorten it, or raise the job's max_prompt_chars"
# A '..' path segment, a leading slash or backslash, or an ASCII control character.
_PATH_LIKE_ID = r"(^|[/\\])\.\.($|[/\\])|^[/\\]|[\x00-\x1f\x7f]"
_NO_NUL = "Remove the NUL characters (\\x00) from the text; they are never part of a caption"
_BOTH_SIZES = "Give both width and height, or neither (the row then uses the job's default bucket)"
_GIVE_SOURCE = (
    "Give every row of an edit job its source image(s): s3://bucket/key, an absolute path, a path "
    "relative to the input file, or the image's bytes (docs/edit-jobs.md)"
)

_FEWER_SOURCES = (
    "Give the row at most that many images (one row per source, each with its instruction), or point "
    "model.path at a model that takes several, such as Qwen-Image-Edit-2509/2511 (QwenImageEditPlusPipeline); "
    "docs/edit-jobs.md lists each model's limit"
)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    for kind, test in (
        ("integer", pa.types.is_integer),
        ("float", pa.types.is_floating),
        ("null", pa.types.is_null),
    ):
        if test(t):
            return kind
    return str(t)


def job_schema(config: RowConfig, schema: pa.Schema) -> pa.Schema:
    """An input file's schema with its columns named as the job knows them
    (RowConfig.prompt_column / id_column read as 'prompt' / 'id')."""
    names = config.job_names(schema.names)
    return pa.schema([schema.field(config.input_name(n)).with_name(n) for n in names])


def valid_sizes(w: pa.Array, h: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]:
    """(valid, width, height): valid is true where both sides are in [1, MAX_SIDE]; the sizes
    come back as int64 with every other row null."""
    valid = pc.fill_null(pc.invert(pc.or_(outside(w, 1, MAX_SIDE), outside(h, 1, MAX_SIDE))), False)
    as64 = [pc.if_else(valid, v, pa.scalar(None, v.type)).cast(pa.int64()) for v in (w, h)]
    return valid, as64[0], as64[1]


def _has_zero_byte(strings: pa.Array) -> bool:
    """Whether any value holds a 0 byte, which in UTF-8 is only ever NUL: one pass over the
    bytes (a substring search per row costs 25x more, for a character that is almost never there)."""
    if pa.types.is_null(strings.type) or len(strings) == 0:
        return False
    _, offsets, data = strings.buffers()
    if data is None:
        return False
    dtype = np.dtype(np.int64 if pa.types.is_large_string(strings.type) else np.int32)  # of the offsets
    ends = np.frombuffer(offsets, dtype, count=len(strings) + 1, offset=strings.offset * dtype.itemsize)
    first, last = int(ends[0]), int(ends[-1])
    used = np.frombuffer(data, np.uint8, count=last - first, offset=first)
    return bool(used.size) and not used.all()


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _At(NamedTuple):
    """Where a batch is: its file and the file row of its first row."""

    file: str
    first_row: int


@dataclass(frozen=True)
class ValidationReport:
    """What validation found: `errors` (up to the cap, in file and row order), `total` problems."""

    errors: tuple[RowError, ...]
    total: int
    rows: int
    files: tuple[InputFile, ...]
    empty_files: tuple[str, ...]
    # What the footers of the files with a valid schema say, read once by the scan (the plan's
    # input identities and row-group warnings): sha256 and largest row group, by uri.
    footer_sha256: Mapping[str, str] = field(default_factory=dict)
    largest_row_groups: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.total == 0

    def raise_if_errors(self) -> None:
        if self.total:
            raise InputError(self.errors, self.total)


class RowValidator:
    """Accumulates the problems of every file's schema and batches."""

    def __init__(self, config: RowConfig, max_errors: int = DEFAULT_MAX_ERRORS) -> None:
        self.config = config
        self.max_errors = max_errors
        self.errors: list[RowError] = []
        self.total = 0
        self._order: dict[str, int] = {}  # file -> input order, for sorting errors

    def add(self, error: RowError, count: int = 1) -> None:
        self.total += count
        if len(self.errors) < self.max_errors:
            self.errors.append(error)

    def merge(self, other: RowValidator) -> None:
        """Take another validator's problems (one file's, scanned on another thread)."""
        self.total += other.total
        room = self.max_errors - len(self.errors)
        self.errors.extend(other.errors[: max(0, room)])

    def sorted_errors(self) -> tuple[RowError, ...]:
        return tuple(
            sorted(self.errors, key=lambda e: (self._order.get(e.file, -1), -1 if e.row is None else e.row))
        )

    def check_schema(self, file: str, schema: pa.Schema) -> bool:
        """Column presence and types; False when the file's rows cannot be checked."""
        self._order.setdefault(file, len(self._order))
        names, config = schema.names, self.config
        shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
        for known in ("prompt", "id"):
            own = config.input_name(known)
            if own != known and own in names and known in names:
                problem = f"there is a '{own}' column (input.{known}_column) and also a '{known}' column"
                hint = f"Rename or drop the '{known}' column: the manifests' '{known}' holds the values of '{own}'"
                self.add(RowError(file, None, known, None, problem, hint))
                return False
        if config.prompt_column not in names:
            problem = f"no '{config.prompt_column}' column (columns: {shown or 'none'})"
            hint = (
                "Name the column that holds the prompts in input.prompt_column (e.g. prompt_column: caption), "
                "or call it 'prompt'"
            )
            self.add(RowError(file, None, config.prompt_column, None, problem, hint))
            return False
        if config.id_column != "id" and config.id_column not in names:
            problem = (
                f"no '{config.id_column}' column, which input.id_column names (columns: {shown or 'none'})"
            )
            hint = "Set input.id_column to the column that holds the ids, or leave it out to use row positions as ids"
            self.add(RowError(file, None, config.id_column, None, problem, hint))
            return False
        if config.image_column is not None and not self._check_image_column(file, schema, shown):
            return False
        schema = job_schema(config, schema)
        names = schema.names
        ok = True
        for column, (kinds, expected) in _EXPECTED.items():
            if column not in names or _kind(schema.field(column).type) in kinds:
                continue
            ok, kind = False, _kind(schema.field(column).type)
            own = config.input_name(column)
            hint = f"Store '{own}' as {expected} values"
            if kind == "float" and expected.startswith("integer"):
                hint += (
                    "; pandas writes an integer column with missing values as float: use the nullable "
                    f"dtype, df['{own}'] = df['{own}'].astype('Int64')"
                )
            elif kind == "string":
                hint += ", not as text"
            problem = f"column has type {schema.field(column).type}, expected {expected}"
            self.add(RowError(file, None, own, None, problem, hint))
        for have, missing in (("width", "height"), ("height", "width")):
            if have in names and missing not in names:
                ok = False
                problem = f"there is a '{have}' column but no '{missing}' column"
                self.add(RowError(file, None, missing, None, problem, _BOTH_SIZES))
        return ok

    def _check_image_column(self, file: str, schema: pa.Schema, shown: str) -> bool:
        """An edit job's image column is there and holds one of the source forms."""
        column = self.config.image_column
        assert column is not None
        if column not in schema.names:
            problem = f"no '{column}' column, which input.image_column names (columns: {shown or 'none'})"
            hint = (
                "Set input.image_column to the column that holds the source images, or leave it out for "
                "a text-to-image job"
            )
            self.add(RowError(file, None, column, None, problem, hint))
            return False
        wrong = column_problem(schema.field(column).type)
        if wrong is not None:
            hint = "Write the column as one of those forms (docs/edit-jobs.md)"
            self.add(RowError(file, None, column, None, wrong, hint))
            return False
        return True

    def _check_sources(self, at: _At, batch: pa.RecordBatch) -> None:
        """Every row of an edit job names at least one source, each in a form a store reads, and
        no more than the model takes (RowConfig.max_sources): the pipeline would refuse such a
        row on every attempt of its shard."""
        column, most = self.config.image_column, self.config.max_sources
        if column is None or column not in batch.schema.names:
            return
        for i, got in enumerate(column_sources(batch.column(column), at.file, at.first_row)):
            if isinstance(got, SourceSpecError):
                self.add(RowError(at.file, at.first_row + i, column, None, str(got), _GIVE_SOURCE))
            elif most is not None and len(got) > most:
                problem = f"{len(got)} source images; the model (model.path) takes at most {most} per row"
                self.add(RowError(at.file, at.first_row + i, column, None, problem, _FEWER_SOURCES))

    def _flag(
        self,
        at: _At,
        column: str,
        mask: pa.Array,
        values: pa.Array,
        problem: str | Callable[[Any], str],
        hint: str,
        show: Callable[[Any], str] = describe_value,
    ) -> None:
        """Record a problem at every row where `mask` is true (null counts as false)."""
        mask = pc.fill_null(mask, False)
        count = pc.sum(mask).as_py() or 0
        if not count:
            return
        self.total += count
        room = self.max_errors - len(self.errors)
        if room <= 0:
            return
        idx = pc.indices_nonzero(mask).slice(0, room)
        column = self.config.input_name(column)
        for i, v in zip(idx.to_pylist(), values.take(idx).to_pylist()):
            text = problem(v) if callable(problem) else problem
            self.errors.append(RowError(at.file, at.first_row + i, column, show(v), text, hint))

    def _check_utf8(self, at: _At, batch: pa.RecordBatch) -> bool:
        """Every string column of the batch is valid UTF-8 (Arrow's full validation; Parquet
        readers do not check it, and a worker turning such a row into text would fail every
        attempt). False when some is not: the batch's other checks would read the bad bytes."""
        ok = True
        for name in batch.schema.names:
            column = batch.column(name)
            if isinstance(column, pa.DictionaryArray):
                column = column.dictionary_decode()
            if _kind(column.type) != "string":
                continue
            try:
                column.validate(full=True)
                continue
            except pa.ArrowInvalid:
                ok = False
            raw = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
            bad = [v is not None and not _is_utf8(v) for v in raw.to_pylist()]
            self._flag(
                at,
                name,
                pa.array(bad, pa.bool_()),
                raw,
                "value is not valid UTF-8",
                "Write the column as text (str, UTF-8), or as binary if it holds bytes; a prompt or id "
                "must be text",
                show=lambda v: describe_value(bytes(v[:60])),
            )
        return ok

    def check_batch(self, batch: pa.RecordBatch, file: str, first_row: int) -> None:
        """Check the rows of `batch`, rows first_row.. of `file` (its schema already checked)."""
        at, names = _At(file, first_row), batch.schema.names
        if not self._check_utf8(at, batch):
            return
        prompt = plain(batch.column("prompt"))
        self._flag(at, "prompt", pc.is_null(prompt), prompt, "prompt is null", _GIVE_PROMPT)
        # Without copying the prompts (trimming would): no bytes, or nothing but whitespace.
        empty = pc.or_(pc.equal(pc.binary_length(prompt), 0), pc.utf8_is_space(prompt))
        self._flag(at, "prompt", empty, prompt, "prompt is empty", _GIVE_PROMPT)
        self._check_nul(at, "prompt", prompt)
        self._check_length(at, "prompt", prompt)
        if "negative_prompt" in names and _kind(batch.schema.field("negative_prompt").type) == "string":
            neg = plain(batch.column("negative_prompt"))
            self._check_length(at, "negative_prompt", neg)
            self._check_nul(at, "negative_prompt", neg)
        if "id" in names:
            ids = batch.column("id")
            self._flag(at, "id", pc.is_null(ids), ids, "id is null", "Give every row an id, or drop the id column to use row positions")  # fmt: skip
            if pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type):
                # Ids name output objects. Keys are escaped anyway (workers.output.layout), but an id that
                # reads as a path climbing out of its folder is almost always a bug upstream.
                climbs = pc.fill_null(pc.match_substring_regex(ids, _PATH_LIKE_ID), False)
                self._flag(at, "id", climbs, ids, "id looks like a path ('..' segment, leading '/' or '\\', or a control character)", "Use ids without path syntax: they name the output objects")  # fmt: skip
        for column, (lo, hi) in _RANGES.items():
            if column in names:
                self._check_range(at, column, plain(batch.column(column)), lo, hi)
        if "width" in names and "height" in names:
            self._check_sizes(at, plain(batch.column("width")), plain(batch.column("height")))
        self._check_sources(at, batch)

    def _check_nul(self, at: _At, column: str, text: pa.Array) -> None:
        """A NUL ends the text early in C-side tokenizers and logs: what is generated would not be
        what the manifest says."""
        if _has_zero_byte(text):
            nul = pc.match_substring(text, "\x00")
            what = column.replace("_", " ")
            self._flag(at, column, nul, text, f"{what} holds a NUL character (\\x00)", _NO_NUL)

    def _check_length(self, at: _At, column: str, text: pa.Array) -> None:
        """At most max_prompt_chars characters. A string has at least as many bytes as characters:
        characters are counted only when some value has more bytes than the limit allows."""
        limit = self.config.max_prompt_chars
        if (pc.max(pc.binary_length(text)).as_py() or 0) > limit:
            long = pc.greater(pc.utf8_length(text), limit)
            what = column.replace("_", " ")
            self._flag(at, column, long, text, f"{what} is longer than {limit} characters", _SHORTEN)

    def _check_range(self, at: _At, column: str, v: pa.Array, lo: float, hi: float) -> None:
        if pa.types.is_null(v.type):
            return
        if pa.types.is_floating(v.type):
            bad = pc.or_(pc.is_nan(v), pc.is_inf(v))
            hint = f"Use a number in [{lo}, {hi}], or null for the job default"
            self._flag(at, column, bad, v, f"{column} is not a finite number", hint)
            v = pc.if_else(bad, pa.scalar(None, v.type), v)
        self._flag(at, column, outside(v, lo, hi), v, f"{column} is outside [{lo}, {hi}]", f"Use a value in [{lo}, {hi}], or null for the job default")  # fmt: skip

    def _check_sizes(self, at: _At, w: pa.Array, h: pa.Array) -> None:
        for column, v, other, other_name in (("width", w, h, "height"), ("height", h, w, "width")):
            one_sided = pc.and_(pc.is_null(v), pc.is_valid(other))
            problem = lambda o, c=column, n=other_name: f"{c} is null while {n} is {o}"  # noqa: E731
            self._flag(at, column, one_sided, other, problem, _BOTH_SIZES, show=lambda o: "null")
            if not pa.types.is_null(v.type):
                self._flag(at, column, outside(v, 1, MAX_SIDE), v, f"{column} is not in [1, {MAX_SIDE}] pixels", "Use a positive size, or null for the default bucket")  # fmt: skip
        buckets = self.config.buckets
        if not buckets.strict or pa.types.is_null(w.type) or pa.types.is_null(h.type):
            return
        valid, w64, h64 = valid_sizes(w, h)  # invalid sizes are reported above, not again here
        exact = pa.array([False] * len(w))
        for b in buckets:
            exact = pc.or_(exact, pc.and_(pc.equal(w64, b.width), pc.equal(h64, b.height)))
        off = pc.and_(valid, pc.invert(pc.fill_null(exact, False)))
        pairs = pa.StructArray.from_arrays([w, h], ["w", "h"])
        hint = f"Use one of {buckets.describe()}, or turn strict bucket matching off to map sizes to the nearest aspect ratio"
        not_a_bucket = "size is not one of the job's buckets (bucket matching is strict)"
        self._flag(at, "width/height", off, pairs, not_a_bucket, hint, show=lambda p: f"{p['w']}x{p['h']}")
