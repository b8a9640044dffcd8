"""Bad prompt input fails in validation, before any GPU work, with an error that names the file,
the row and the column and says what to do. Real Parquet files in a temp dir, no mocks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.input.row_errors import InputError
from ditfleet.driver.input.scan import validate_input
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.workers.rows import RowConfig, read_shard_rows
from ditfleet.workers.storage.input_files import filesystem_for

CONFIG = RowConfig(buckets=default_buckets("tiny"))
STRICT = RowConfig(buckets=default_buckets("tiny", strict=True))
CAPTION_KEY = RowConfig(buckets=default_buckets("tiny"), prompt_column="caption", id_column="key")


def write(path: Path, columns: dict, schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def ok_prompts(n: int) -> list[str]:
    return [f"a photo of thing {i}" for i in range(n)]


@dataclass
class Case:
    name: str
    build: Callable[[Path], str]  # writes the input under tmp_path, returns the input uri
    file: str  # file name that must appear in the error
    row: int | None  # row that must appear (None: a file- or schema-level problem)
    column: str | None
    says: str  # a fragment of the problem text
    hint: str  # a fragment of what to do
    config: RowConfig = CONFIG


def _dup_ids(tmp: Path) -> str:
    write(tmp / "in" / "a.parquet", {"id": ["x", "y", "z"], "prompt": ok_prompts(3)})
    write(tmp / "in" / "b.parquet", {"id": ["w", "y"], "prompt": ok_prompts(2)})
    return str(tmp / "in")


def _int_and_str_ids(tmp: Path) -> str:
    write(tmp / "in" / "a.parquet", {"id": [5, 7], "prompt": ok_prompts(2)})
    write(tmp / "in" / "b.parquet", {"id": ["6", "7"], "prompt": ok_prompts(2)})
    return str(tmp / "in")


def _position_vs_id(tmp: Path) -> str:
    # a.parquet has no ids: its rows are "0", "1", "2"; b.parquet names one of its rows "1".
    write(tmp / "in" / "a.parquet", {"prompt": ok_prompts(3)})
    write(tmp / "in" / "b.parquet", {"id": ["q", "1"], "prompt": ok_prompts(2)})
    return str(tmp / "in")


def _not_parquet(tmp: Path) -> str:
    (tmp / "prompts.parquet").write_text("prompt\na cat\n")
    return str(tmp / "prompts.parquet")


def _empty_dir(tmp: Path) -> str:
    (tmp / "in").mkdir()
    (tmp / "in" / "notes.txt").write_text("prompts go here")
    return str(tmp / "in")


def _invalid_utf8(column: str) -> Callable[[Path], str]:
    """A file whose `column` holds bytes that are not UTF-8 under a string type (a binary column
    relabelled as string, as a careless writer leaves them), written uncompressed."""

    def build(tmp: Path) -> str:
        raw = pa.array([b"fine", b"caf\xe9 au lait", b"ok"], pa.binary()).view(pa.string())
        columns = {"prompt": ok_prompts(3), "id": ["a", "b", "c"], "source": ["x", "y", "z"]}
        columns[column] = raw
        path = tmp / "p.parquet"
        pq.write_table(pa.table(columns), path, compression="none")
        assert pq.read_table(path).schema.field(column).type == pa.string()
        return str(path)

    return build


def _single(columns: dict, schema: pa.Schema | None = None) -> Callable[[Path], str]:
    return lambda tmp: str(write(tmp / "p.parquet", columns, schema))


CASES = [
    Case("missing prompt column", _single({"text": ["a cat"]}), "p.parquet", None, "prompt", "no 'prompt' column (columns: text)", "input.prompt_column (e.g. prompt_column: caption)"),
    Case("missing caption column", _single({"prompt": ["a cat"]}), "p.parquet", None, "caption", "no 'caption' column (columns: prompt)", "input.prompt_column", CAPTION_KEY),
    Case("missing key column", _single({"caption": ["a cat"], "id": ["x"]}), "p.parquet", None, "key", "no 'key' column, which input.id_column names (columns: caption, id)", "leave it out to use row positions", CAPTION_KEY),
    Case("caption column and a prompt column", _single({"caption": ["a cat"], "prompt": ["a dog"]}), "p.parquet", None, "prompt", "there is a 'caption' column (input.prompt_column) and also a 'prompt' column", "Rename or drop the 'prompt' column", CAPTION_KEY),
    Case("empty caption", _single({"caption": ["a", ""], "key": ["x", "y"]}), "p.parquet", 1, "caption", "prompt is empty", "Give every row a prompt", CAPTION_KEY),
    Case("duplicate keys", _single({"caption": ["a", "b"], "key": ["x", "x"]}), "p.parquet", 1, "key", "id 'x' is already used by", "unique", CAPTION_KEY),
    Case("caption of a wrong type", _single({"caption": [1, 2], "key": ["x", "y"]}), "p.parquet", None, "caption", "type int64, expected string", "Store 'caption' as string", CAPTION_KEY),
    Case("invalid UTF-8 in a prompt", _invalid_utf8("prompt"), "p.parquet", 1, "prompt", "value is not valid UTF-8 (value: b'caf\\xe9 au lait')", "Write the column as text"),
    Case("invalid UTF-8 in an id", _invalid_utf8("id"), "p.parquet", 1, "id", "value is not valid UTF-8", "Write the column as text"),
    Case("invalid UTF-8 in a pass-through column", _invalid_utf8("source"), "p.parquet", 1, "source", "value is not valid UTF-8", "Write the column as text"),
    Case("NUL in a prompt", _single({"prompt": ["a cat", "a\x00dog"]}), "p.parquet", 1, "prompt", "prompt holds a NUL character", "Remove the NUL characters"),
    Case("NUL in a negative prompt", _single({"prompt": ["a", "b"], "negative_prompt": ["x\x00", None]}), "p.parquet", 0, "negative_prompt", "negative prompt holds a NUL character", "Remove the NUL"),
    Case("prompt is not a string", _single({"prompt": [1, 2]}), "p.parquet", None, "prompt", "type int64, expected string", "Store 'prompt' as string"),
    Case("null prompt", _single({"prompt": ["a", None, "b"]}), "p.parquet", 1, "prompt", "prompt is null", "Give every row a prompt"),
    Case("empty prompt", _single({"prompt": ["a", "b", "  \t "]}), "p.parquet", 2, "prompt", "prompt is empty", "Give every row a prompt"),
    Case("100k-character prompt", _single({"prompt": ["a", "x" * 100_000]}), "p.parquet", 1, "prompt", "longer than 4000 characters", "max_prompt_chars"),
    Case(
        "size off the buckets in strict mode",
        _single({"prompt": ok_prompts(2), "width": [128, 1000], "height": [128, 700]}),
        "p.parquet", 1, "width/height", "not one of the job's buckets (bucket matching is strict) (value: 1000x700)",
        "128x128, 160x96, 96x160", STRICT,
    ),
    Case("width without height", _single({"prompt": ok_prompts(2), "width": [128, 160], "height": [128, None]}), "p.parquet", 1, "height", "height is null while width is 160", "both width and height"),
    Case("width column without height column", _single({"prompt": ok_prompts(2), "width": [128, 160]}), "p.parquet", None, "height", "'width' column but no 'height' column", "both width and height"),
    Case("zero width", _single({"prompt": ok_prompts(2), "width": [0, 128], "height": [128, 128]}), "p.parquet", 0, "width", "width is not in [1, 16384]", "positive size"),
    Case("huge unsigned width", _single({"prompt": ok_prompts(1), "width": pa.array([2**64 - 1], pa.uint64()), "height": [128]}), "p.parquet", 0, "width", "width is not in [1, 16384]", "positive size"),
    Case("negative steps", _single({"prompt": ok_prompts(3), "steps": [20, 30, -4]}), "p.parquet", 2, "steps", "steps is outside [1, 200] (value: -4)", "Use a value in [1, 200]"),
    Case("steps as float (pandas)", _single({"prompt": ok_prompts(2), "steps": [20.0, math.nan]}), "p.parquet", None, "steps", "type double, expected integer", "astype('Int64')"),
    Case("NaN cfg", _single({"prompt": ok_prompts(2), "true_cfg_scale": [4.0, math.nan]}), "p.parquet", 1, "true_cfg_scale", "not a finite number", "Use a number in [0.0, 50.0]"),
    Case("cfg too large", _single({"prompt": ok_prompts(2), "true_cfg_scale": [4.0, 51.0]}), "p.parquet", 1, "true_cfg_scale", "outside [0.0, 50.0]", "Use a value"),
    Case("negative seed", _single({"prompt": ok_prompts(2), "seed": [1, -1]}), "p.parquet", 1, "seed", "seed is outside [0, 9223372036854775807]", "Use a value"),
    Case("num_images 0", _single({"prompt": ok_prompts(2), "num_images": [0, 2]}), "p.parquet", 0, "num_images", "num_images is outside [1, 16]", "Use a value"),
    Case("null id", _single({"id": ["a", None], "prompt": ok_prompts(2)}), "p.parquet", 1, "id", "id is null", "Give every row an id"),
    Case("id with ../", _single({"id": ["a", "../../etc/x"], "prompt": ok_prompts(2)}), "p.parquet", 1, "id", "id looks like a path", "Use ids without path syntax"),
    Case("id with a control character", _single({"id": ["a\x00b", "c"], "prompt": ok_prompts(2)}), "p.parquet", 0, "id", "id looks like a path", "Use ids without path syntax"),
    Case("duplicate ids across two files", _dup_ids, "b.parquet", 1, "id", "id 'y' is already used by", "unique across all input files"),
    Case("integer 7 and string '7'", _int_and_str_ids, "b.parquet", 1, "id", "id '7' is already used by", "unique"),
    Case("position id collides with a given id", _position_vs_id, "b.parquet", 1, "id", "id '1' is already used by", "unique"),
    Case("empty file", _single({"prompt": pa.array([], pa.string())}), "p.parquet", None, None, "the file has no rows", "Check that the prompts were written"),
    Case("not a Parquet file", _not_parquet, "prompts.parquet", None, None, "not a Parquet file", "to_parquet"),
    Case("missing file", lambda tmp: str(tmp / "nope.parquet"), "nope.parquet", None, None, "no such file or directory", "Check the input path"),
    Case("directory without parquet files", _empty_dir, "in", None, None, "directory has no .parquet files (it holds: notes.txt)", "point the input at the file"),
    Case("glob without matches", lambda tmp: str(tmp / "*.parquet"), "*.parquet", None, None, "no files match this pattern", "Check the pattern"),
    Case("id of a wrong type", _single({"id": [1.5, 2.5], "prompt": ok_prompts(2)}), "p.parquet", None, "id", "type double, expected string or integer", "Store 'id'"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_is_refused_with_a_clear_error(tmp_path: Path, case: Case):
    uri = case.build(tmp_path)
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(uri), PlanConfig(rows=case.config))
    message = str(raised.value)
    lines = [line for line in message.splitlines()[1:] if case.says in line]
    assert lines, f"no error says {case.says!r}:\n{message}"
    line = lines[0]
    assert case.file in line
    if case.row is not None:
        assert f"row {case.row}," in line
    else:
        assert ": row " not in line
    if case.column is not None:
        assert f"column '{case.column}'" in line
    assert case.hint in line
    # validate() reports the same problems without raising.
    report = validate_input(PromptSource(uri), case.config)
    assert not report.ok and any(case.says in str(e) for e in report.errors)


def test_duplicate_error_names_both_rows(tmp_path: Path):
    with pytest.raises(InputError) as raised:
        plan_job(PromptSource(_dup_ids(tmp_path)), PlanConfig(rows=CONFIG))
    (err,) = raised.value.errors
    assert err.file.endswith("b.parquet") and err.row == 1 and err.column == "id"
    assert f"{tmp_path / 'in' / 'a.parquet'} row 1" in err.message


def test_all_problems_are_counted_and_the_first_ones_shown(tmp_path: Path):
    n = 300
    prompts = [None if i % 2 else f"p{i}" for i in range(n)]  # 150 nulls
    write(tmp_path / "in" / "a.parquet", {"prompt": prompts, "steps": [0] * n})  # 300 bad steps
    write(tmp_path / "in" / "b.parquet", {"prompt": ["ok", ""]})  # 1 empty prompt
    report = validate_input(PromptSource(str(tmp_path / "in")), CONFIG, max_errors=50)
    assert report.total == 150 + 300 + 1
    assert len(report.errors) == 50
    with pytest.raises(InputError) as raised:
        report.raise_if_errors()
    text = str(raised.value)
    assert text.startswith("the prompt input has 451 problems (the first 50 are shown):")
    assert text.rstrip().endswith("... and 401 more.")
    # Shown in file and row order.
    rows = [(e.file, e.row) for e in report.errors]
    assert rows == sorted(rows)


def test_problems_in_several_files_are_all_reported(tmp_path: Path):
    write(tmp_path / "in" / "a.parquet", {"prompt": ok_prompts(2), "num_images": [1, 99]})
    (tmp_path / "in" / "b.parquet").write_bytes(b"not parquet at all")
    write(tmp_path / "in" / "c.parquet", {"text": ["x"]})
    report = validate_input(PromptSource(str(tmp_path / "in")), CONFIG)
    text = "\n".join(str(e) for e in report.errors)
    assert report.total == 3
    assert "a.parquet: row 1, column 'num_images'" in text
    assert "b.parquet: not a Parquet file" in text
    assert "c.parquet: column 'prompt': no 'prompt' column" in text


def test_valid_input_passes_with_optional_columns_and_nulls(tmp_path: Path):
    columns = {
        "id": [10, 11, 12],
        "prompt": ["a", "b", "c"],
        "negative_prompt": ["blurry", None, ""],
        "seed": pa.array([None, 0, 2**63 - 1], pa.int64()),
        "width": pa.array([None, 160, 96], pa.int32()),
        "height": pa.array([None, 96, 160], pa.int32()),
        "steps": pa.array([None, 1, 200], pa.int16()),
        "true_cfg_scale": [None, 0.0, 50.0],
        "num_images": pa.array([1, None, 16], pa.uint8()),
        "note": ["x", None, "z"],
    }
    write(tmp_path / "p.parquet", columns)
    report = validate_input(PromptSource(str(tmp_path / "p.parquet")), STRICT)
    assert report.ok and report.rows == 3, [str(e) for e in report.errors]


def test_prompt_and_id_columns_named_otherwise_are_read_as_prompt_and_id(tmp_path: Path):
    path = write(
        tmp_path / "p.parquet", {"key": ["k1", "k2", "k3"], "caption": ok_prompts(3), "url": ["u"] * 3}
    )
    assert validate_input(PromptSource(str(path)), CAPTION_KEY).ok
    plan = plan_job(PromptSource(str(path)), PlanConfig(rows=CAPTION_KEY, shard_size=2))
    rows = [r for s in plan.shards for r in read_shard_rows(s, filesystem_for("/"), CAPTION_KEY)]
    assert [(r.id, r.prompt, r.extra) for r in rows] == [
        (f"k{i + 1}", p, {"url": "u"}) for i, p in enumerate(ok_prompts(3))
    ]
    # Without an id column of its name, the default reads positions, as a file without 'id' does.
    no_key = RowConfig(buckets=default_buckets("tiny"), prompt_column="caption")
    plan = plan_job(PromptSource(str(path)), PlanConfig(rows=no_key))
    (shard,) = plan.shards
    assert [(r.id, r.extra) for r in read_shard_rows(shard, filesystem_for("/"), no_key)] == [
        (str(i), {"key": f"k{i + 1}", "url": "u"}) for i in range(3)
    ]
    assert plan.fingerprint_doc()["prompt_column"] == "caption" and "id_column" not in plan.fingerprint_doc()


def test_dictionary_encoded_and_large_string_prompts_are_accepted(tmp_path: Path):
    prompts = pa.array(["a", "b", "a", "  "]).dictionary_encode()
    write(
        tmp_path / "p.parquet", {"prompt": prompts, "id": pa.array(["1", "2", "3", "4"], pa.large_string())}
    )
    report = validate_input(PromptSource(str(tmp_path / "p.parquet")), CONFIG)
    assert report.total == 1 and report.errors[0].row == 3 and report.errors[0].message == "prompt is empty"


def test_an_empty_file_next_to_others_is_skipped_and_listed(tmp_path: Path):
    write(tmp_path / "in" / "a.parquet", {"prompt": ok_prompts(2)})
    write(tmp_path / "in" / "b.parquet", {"prompt": pa.array([], pa.string())})
    plan = plan_job(PromptSource(str(tmp_path / "in")), PlanConfig(rows=CONFIG))
    assert plan.total_rows == 2
    assert plan.empty_files == (str(tmp_path / "in" / "b.parquet"),)
