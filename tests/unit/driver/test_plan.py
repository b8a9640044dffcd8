"""Planning: shards over real Parquet files, seeds and ids that never depend on how the work is cut,
the worker's re-read of a shard, fingerprints, and the cost of planning a large input."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import hashlib
import json
import pickle
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.output.job_file import describe_differences, fingerprint_differences, job_document
from ditfleet.driver.plan import JobPlan, PlanConfig, plan_job
from ditfleet.workers.rows import (
    InputContentChanged,
    PromptRow,
    RowConfig,
    ShardSpec,
    derive_seed,
    read_shard_rows,
    resolve_rows,
)
from ditfleet.workers.storage.input_files import InputFileError, filesystem_for
from tests.support.paths import REPO

ROWS = RowConfig(job_seed=1234, buckets=default_buckets("tiny"), steps=4, true_cfg_scale=3.0)
LOCAL = filesystem_for("/")


def write(path: Path, columns: dict, row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def all_rows(plan: JobPlan, fs=LOCAL) -> list[PromptRow]:
    return [r for s in plan.shards for r in read_shard_rows(s, fs, plan.config.rows)]


def plan_of(uri: str | Path, shard_size: int = 16, rows: RowConfig = ROWS, **kw) -> JobPlan:
    return plan_job(PromptSource(str(uri)), PlanConfig(rows=rows, shard_size=shard_size, **kw))


def test_derive_seed_is_a_documented_fixed_function():
    # Same numbers on every machine and run: these values are part of the output's contract.
    assert derive_seed(0, "0") == 3991178565366665576
    assert derive_seed(0, "a") == 7232181096286263633
    assert derive_seed(1, "a") == 1139052980633791646
    data = (2**63 - 1).to_bytes(8, "big") + "café/../x".encode()
    digest = hashlib.blake2b(data, digest_size=8, person=b"ditfleet-seed").digest()
    assert derive_seed(2**63 - 1, "café/../x") == int.from_bytes(digest, "big") & (2**63 - 1)
    with pytest.raises(ValueError, match="job seed"):
        derive_seed(-1, "a")


def test_seeds_and_ids_do_not_depend_on_shard_size(tmp_path: Path):
    n = 100
    write(tmp_path / "in" / "a.parquet", {"prompt": [f"p{i}" for i in range(n)]}, row_group_size=30)
    seeds = pa.array([7 if i % 10 == 0 else None for i in range(n)], pa.int64())
    write(
        tmp_path / "in" / "b.parquet",
        {"prompt": [f"q{i}" for i in range(n)], "seed": seeds},
        row_group_size=17,
    )
    by_size = {}
    for shard_size in (1, 7, 32, 1000):
        plan = plan_of(tmp_path / "in", shard_size)
        by_size[shard_size] = [(r.id, r.seed, r.prompt) for r in all_rows(plan)]
    assert by_size[1] == by_size[7] == by_size[32] == by_size[1000]
    rows = by_size[7]
    assert [r[0] for r in rows] == [str(i) for i in range(2 * n)]  # positions across both files
    assert rows[3][1] == derive_seed(1234, "3")
    assert rows[n][1] == 7 and rows[n + 1][1] == derive_seed(1234, str(n + 1))  # given, then derived
    assert len({r[1] for r in rows}) == 2 * n - 9  # derived seeds are distinct; ten rows share 7


def test_seeds_follow_the_id_not_the_row_order(tmp_path: Path):
    ids = [f"img-{i}" for i in range(40)]
    write(tmp_path / "one" / "all.parquet", {"id": ids, "prompt": ids})
    rev = ids[::-1]
    write(tmp_path / "two" / "x.parquet", {"id": rev[:25], "prompt": rev[:25]})
    write(tmp_path / "two" / "y.parquet", {"id": rev[25:], "prompt": rev[25:]})
    a = {r.id: r.seed for r in all_rows(plan_of(tmp_path / "one", 8))}
    b = {r.id: r.seed for r in all_rows(plan_of(tmp_path / "two", 5))}
    assert a == b and len(a) == 40
    other = {
        r.id: r.seed
        for r in all_rows(plan_of(tmp_path / "one", 8, rows=RowConfig(job_seed=1, buckets=ROWS.buckets)))
    }
    assert all(other[i] != a[i] for i in ids)


def test_multi_file_plan_covers_every_row_once_in_order(tmp_path: Path):
    sizes = {"a.parquet": 45, "b.parquet": 3, "c.parquet": 0, "d.parquet": 40}
    for name, n in sizes.items():
        write(
            tmp_path / "in" / name,
            {
                "prompt": pa.array([f"{name}-{i}" for i in range(n)], pa.string()),
                "width": pa.array([160 if i % 4 == 0 else None for i in range(n)], pa.int64()),
                "height": pa.array([96 if i % 4 == 0 else None for i in range(n)], pa.int64()),
                "num_images": pa.array([1 + i % 3 for i in range(n)], pa.int64()),
            },
            row_group_size=11,
        )
    (tmp_path / "in" / "_SUCCESS").write_text("")  # ignored, as are hidden files
    (tmp_path / "in" / ".a.parquet.crc").write_text("")
    plan = plan_of(tmp_path / "in", shard_size=16)
    assert [i.uri.rsplit("/", 1)[1] for i in plan.inputs] == [
        "a.parquet",
        "b.parquet",
        "c.parquet",
        "d.parquet",
    ]
    assert plan.empty_files == (str(tmp_path / "in" / "c.parquet"),)
    # Shards never span files; a file's last shard is short.
    assert [(s.file.rsplit("/", 1)[1], s.row_start, s.row_stop) for s in plan.shards] == [
        ("a.parquet", 0, 16), ("a.parquet", 16, 32), ("a.parquet", 32, 45), ("b.parquet", 0, 3),
        ("d.parquet", 0, 16), ("d.parquet", 16, 32), ("d.parquet", 32, 40),
    ]  # fmt: skip
    assert [s.index for s in plan.shards] == list(range(7))
    assert [s.position_start for s in plan.shards] == [0, 16, 32, 45, 48, 64, 80]
    rows = all_rows(plan)
    assert [r.prompt for r in rows] == [f"{n}-{i}" for n, k in sizes.items() for i in range(k)]
    assert plan.total_rows == 88 == len(rows)
    assert plan.total_images == sum(r.num_images for r in rows)
    # Each shard's counts agree with what the worker resolves.
    for s in plan.shards:
        mine = read_shard_rows(s, LOCAL, ROWS)
        assert s.num_images == sum(r.num_images for r in mine)
        assert set(s.buckets_used) == {r.bucket for r in mine}
    assert plan.buckets_used == ("128x128", "160x96")
    assert plan.bucket_usage == {"128x128": 7, "160x96": 7}  # row 0 of every shard is 160x96
    per_bucket = {b: sum(r.num_images for r in rows if r.bucket == b) for b in plan.buckets_used}
    assert plan.images_per_bucket == per_bucket and sum(per_bucket.values()) == plan.total_images


def test_sizes_map_to_buckets_like_the_worker_does(tmp_path: Path):
    widths = [1920, 1080, 512, 128, 100, 96]
    heights = [1080, 1920, 512, 128, 130, 160]
    write(tmp_path / "p.parquet", {"prompt": ["x"] * 6, "width": widths, "height": heights})
    plan = plan_of(tmp_path / "p.parquet", shard_size=2)
    rows = all_rows(plan)
    assert [r.bucket for r in rows] == ["160x96", "96x160", "128x128", "128x128", "96x160", "96x160"]
    assert [(r.width, r.height) for r in rows[:2]] == [(160, 96), (96, 160)]
    assert [(r.requested_width, r.requested_height) for r in rows[:2]] == [(1920, 1080), (1080, 1920)]
    assert [s.buckets_used for s in plan.shards] == [("160x96", "96x160"), ("128x128",), ("96x160",)]


def test_resolve_rows_defaults_and_pass_through_columns(tmp_path: Path):
    table = pa.table(
        {
            "id": [3, 4],
            "prompt": ["a cat", "a dog"],
            "negative_prompt": [None, "blurry"],
            "steps": pa.array([None, 9], pa.int32()),
            "true_cfg_scale": [None, 1.5],
            "when": pa.array([dt.datetime(2024, 5, 1, 12, 30), None], pa.timestamp("us")),
            "price": pa.array([decimal.Decimal("1.10"), decimal.Decimal("-2")], pa.decimal128(5, 2)),
            "blob": [b"\x00\xff", b""],
            "tags": [["a", "b"], []],
            "meta": [{"k": 1}, {"k": None}],
            "__index_level_0__": [10, 11],  # pandas' saved index: not a pass-through column
        }
    )
    shard = ShardSpec(
        0, "f.parquet", row_start=5, row_stop=7, position_start=5, buckets_used=(), num_images=2
    )
    rows = resolve_rows(table.to_batches()[0], ROWS, shard, first_row=5)
    a, b = rows
    assert (a.id, a.row, a.file) == ("3", 5, "f.parquet")
    assert a.negative_prompt == " " and b.negative_prompt == "blurry"
    assert (a.steps, b.steps, a.true_cfg_scale, b.true_cfg_scale) == (4, 9, 3.0, 1.5)
    assert (a.bucket, a.width, a.height, a.requested_width) == ("128x128", 128, 128, None)
    assert a.num_images == 1 and a.seed == derive_seed(1234, "3")
    assert a.extra == {
        "when": "2024-05-01T12:30:00",
        "price": "1.10",
        "blob": "AP8=",
        "tags": ["a", "b"],
        "meta": {"k": 1},
    }
    assert b.extra["when"] is None and b.extra["price"] == "-2.00"
    json.dumps([r.extra for r in rows])  # JSON-safe


def test_shard_read_only_touches_its_rows_and_detects_a_changed_file(tmp_path: Path):
    path = write(tmp_path / "p.parquet", {"prompt": [f"p{i}" for i in range(50)]}, row_group_size=7)
    plan = plan_of(path, shard_size=10)
    shard = plan.shards[2]
    rows = read_shard_rows(shard, LOCAL, ROWS)
    assert [r.row for r in rows] == list(range(20, 30)) and [r.id for r in rows] == [
        str(i) for i in range(20, 30)
    ]
    write(path, {"prompt": [f"p{i}" for i in range(25)]})  # the input is replaced, shorter
    with pytest.raises(
        InputFileError, match=r"p\.parquet: has 25 rows, but shard 2 was planned for rows 20\.\.29"
    ):
        read_shard_rows(shard, LOCAL, ROWS)
    write(path, {"prompt": [f"p{i}" for i in range(50)], "num_images": [2] * 50})
    with pytest.raises(
        InputContentChanged, match=r"rows 20\.\.29 \(shard 2\) changed since the output was planned"
    ):
        read_shard_rows(shard, LOCAL, ROWS)
    # Without a recorded digest (a plan made before them) the counts still catch it.
    with pytest.raises(InputFileError, match="now ask for 20 images in 10 rows"):
        read_shard_rows(dataclasses.replace(shard, content_digest=None), LOCAL, ROWS)


def _edit_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Overwrite bytes of an uncompressed Parquet file: same size, same footer."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old) == 1
    footer = data[-(8 + int.from_bytes(data[-8:-4], "little")) :]
    path.write_bytes(data.replace(old, new))
    assert path.read_bytes()[-len(footer) :] == footer


def test_a_same_length_prompt_edit_under_the_same_footer_is_refused_by_the_worker(tmp_path: Path):
    path = tmp_path / "p.parquet"
    prompts = [f"a photo of item {i:03d}" for i in range(40)]
    pq.write_table(
        pa.table({"prompt": prompts, "source": ["web"] * 40}),
        path,
        compression="none",
        use_dictionary=False,
        write_statistics=False,
    )
    plan = plan_of(path, shard_size=10)
    assert all(s.content_digest is not None for s in plan.shards)
    _edit_in_place(path, b"a photo of item 023", b"a photo of item 999")
    assert [r.prompt for r in read_shard_rows(plan.shards[0], LOCAL, ROWS)] == prompts[:10]  # untouched
    with pytest.raises(InputContentChanged) as e:
        read_shard_rows(plan.shards[2], LOCAL, ROWS)
    message = str(e.value)
    assert str(path) in message and "rows 20..29 (shard 2)" in message
    assert "changed since the output was planned" in message and "new output, or restore the file" in message
    # Planned again, the edited file has another identity: the driver's re-scan sees it too.
    again = plan_of(path, shard_size=10)
    assert again.inputs[0].footer_sha256 == plan.inputs[0].footer_sha256
    assert again.inputs[0].content_digest != plan.inputs[0].content_digest
    assert [s.content_digest for s in again.shards] != [s.content_digest for s in plan.shards]
    assert again.fingerprint() != plan.fingerprint()
    (difference,) = describe_differences(plan.fingerprint_doc(), again.fingerprint_doc())
    assert str(path) in difference and "rows edited in place" in difference


def test_the_content_digest_is_of_values_not_of_how_they_are_stored(tmp_path: Path):
    table = pa.table(
        {
            "prompt": [f"p{i}" for i in range(30)],
            "id": [f"k{i}" for i in range(30)],
            "seed": pa.array(range(30), pa.int32()),
            "meta": [{"a": i, "tags": ["x"] * (i % 3)} for i in range(30)],
        }
    )
    a = write(tmp_path / "a.parquet", {n: table.column(n) for n in table.column_names}, row_group_size=7)
    b = tmp_path / "b.parquet"  # other row groups, compression, column order and integer width
    pq.write_table(
        table.select(["meta", "seed", "id", "prompt"]).set_column(
            1, "seed", table.column("seed").cast(pa.int64())
        ),
        b,
        row_group_size=11,
        compression="zstd",
    )
    da = [s.content_digest for s in plan_of(a, shard_size=8).shards]
    assert da == [s.content_digest for s in plan_of(b, shard_size=8).shards]
    # A pass-through value counts: it goes into the manifest.
    edited = table.set_column(
        3, "meta", pa.array([{"a": i + (i == 17), "tags": ["x"] * (i % 3)} for i in range(30)])
    )
    pq.write_table(edited, a, row_group_size=7)
    changed = [s.content_digest for s in plan_of(a, shard_size=8).shards]
    assert [x != y for x, y in zip(da, changed)] == [False, False, True, False]


def test_fingerprint_is_stable_and_says_what_changed(tmp_path: Path):
    write(tmp_path / "in" / "a.parquet", {"prompt": ["x", "y"]})
    write(tmp_path / "in" / "b.parquet", {"prompt": ["z"]})
    settings = {"model": "tiny", "revision": "abc", "dtype": "float32"}
    first = plan_of(tmp_path / "in", image_settings=settings)
    again = plan_of(tmp_path / "in", image_settings=dict(settings))
    assert first.fingerprint() == again.fingerprint() and len(first.fingerprint()) == 64
    assert describe_differences(again.fingerprint_doc(), first.fingerprint_doc()) == []

    seed = plan_of(
        tmp_path / "in",
        rows=RowConfig(job_seed=9, buckets=ROWS.buckets, steps=4, true_cfg_scale=3.0),
        image_settings=settings,
    )
    assert seed.fingerprint() != first.fingerprint()
    assert describe_differences(first.fingerprint_doc(), seed.fingerprint_doc()) == [
        "job_seed: 1234 in the existing output, 9 now"
    ]

    revision = plan_of(tmp_path / "in", image_settings={**settings, "revision": "def"})
    assert describe_differences(first.fingerprint_doc(), revision.fingerprint_doc()) == [
        "image_settings.revision: 'abc' in the existing output, 'def' now"
    ]

    write(tmp_path / "in" / "b.parquet", {"prompt": ["w"]})  # same size, other content
    write(tmp_path / "in" / "c.parquet", {"prompt": ["v"]})
    changed = plan_of(tmp_path / "in", image_settings=settings)
    assert describe_differences(first.fingerprint_doc(), changed.fingerprint_doc()) == [
        f"input file {tmp_path / 'in' / 'c.parquet'} was added",
        f"input file {tmp_path / 'in' / 'b.parquet'} changed (content differs)",
    ]


def test_job_document_and_resume_check(tmp_path: Path):
    write(tmp_path / "p.parquet", {"prompt": ["x", "y", "z"], "num_images": [1, 2, 3]})
    plan = plan_of(tmp_path / "p.parquet", shard_size=2, image_settings={"model": "tiny"})
    doc = json.loads(json.dumps(job_document(plan, {"output": "s3://b/out"}, versions={"torch": "x"})))
    assert doc["spec"] == {"output": "s3://b/out"} and doc["versions"] == {"torch": "x"}
    assert doc["fingerprint"] == plan.fingerprint()
    assert doc["plan"]["rows"] == 3 and doc["plan"]["images"] == 6 and doc["plan"]["shards"] == 2
    assert fingerprint_differences(doc, plan.fingerprint(), plan.fingerprint_doc()) == []
    other = plan_of(tmp_path / "p.parquet", shard_size=3, image_settings={"model": "tiny"})
    assert fingerprint_differences(doc, other.fingerprint(), other.fingerprint_doc()) == [
        "shard_size: 2 in the existing output, 3 now"
    ]
    assert set(job_document(plan, {})["versions"]) == {"python", "ditfleet", "torch", "pyarrow"}


def test_glob_and_directory_resolution(tmp_path: Path):
    for rel in ("x/2.parquet", "x/10.parquet", "x/sub/1.parquet", "y/3.parquet", "x/notes.txt"):
        if rel.endswith(".parquet"):
            write(tmp_path / rel, {"prompt": [rel]})
        else:
            (tmp_path / rel).write_text("")

    def names(uri: Path | str) -> list[str]:
        return [f.uri[len(str(tmp_path)) + 1 :] for f in PromptSource(str(uri)).files()]

    assert names(tmp_path / "x") == ["x/10.parquet", "x/2.parquet", "x/sub/1.parquet"]  # string order
    assert names(tmp_path / "x" / "*.parquet") == ["x/10.parquet", "x/2.parquet"]
    assert names(tmp_path / "*" / "**" / "*.parquet") == [
        "x/10.parquet",
        "x/2.parquet",
        "x/sub/1.parquet",
        "y/3.parquet",
    ]
    assert names(tmp_path / "?" / "[0-9].parquet") == ["x/2.parquet", "y/3.parquet"]
    assert names(tmp_path / "y" / "3.parquet") == ["y/3.parquet"]


def _big_input(path: Path, n: int) -> None:
    ids = pa.array([f"row-{i:07d}" for i in range(n)])
    prompts = _prompts(n)
    sizes = pa.array([160 if i % 3 == 0 else None for i in range(n)], pa.int32())
    heights = pa.array([96 if i % 3 == 0 else None for i in range(n)], pa.int32())
    pq.write_table(
        pa.table({"id": ids, "prompt": prompts, "width": sizes, "height": heights}),
        path,
        row_group_size=65536,
    )


def _prompts(n: int) -> pa.Array:
    base = [
        f"a painting of a {w} at dusk, detailed, {w} in the foreground"
        for w in ("cat", "harbour", "forest", "street")
    ]
    return pa.array([base[i % 4] + f" #{i}" for i in range(n)])


def test_planning_200k_rows_is_fast_and_holds_no_rows(tmp_path: Path):
    n = 200_000
    path = tmp_path / "big.parquet"
    _big_input(path, n)
    config = PlanConfig(rows=ROWS, shard_size=256)
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        plan = plan_job(PromptSource(str(path)), config)
        elapsed = time.perf_counter() - t0
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.total_rows == n and len(plan.shards) == -(-n // 256)
    # Python-side memory stays far below one object per row (200k PromptRows would be >100 MB):
    # what remains is a read batch at a time plus 8-byte id hashes in Arrow memory.
    assert python_peak < 40 * 2**20, python_peak
    # The plan itself is O(shards): a few hundred bytes per shard.
    assert len(pickle.dumps(plan)) < 400 * len(plan.shards)
    # Generous for 2 shared cores (tracemalloc slows Python code); ~1 s unloaded.
    assert elapsed < 30, elapsed


@pytest.mark.slow
def test_bench_script_prints_one_json_line(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "driver_scale.py"), "--rows", "20000", "--shard-size", "500"],
        capture_output=True, text=True, timeout=300, check=True, cwd=tmp_path,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["bench"] == "driver_plan" and result["rows"] == 20000 and result["shards"] == 40
    assert result["plan_s"] > 0 and result["plan_peak_rss_mb"] >= result["rss_before_plan_mb"] > 0


def test_planning_reads_each_footer_once(tmp_path: Path, monkeypatch):
    """The scan's one footer read gives the plan the files' identities (footer sha256) and their
    row groups' sizes, and the row pass opens each file with it: no footer is read again."""
    from ditfleet.workers.storage import input_files

    for name in ("a", "b", "c"):
        write(
            tmp_path / "in" / f"{name}.parquet",
            {"prompt": [f"{name}{i}" for i in range(40)]},
            row_group_size=40,
        )
    reads: list[str] = []
    footer_bytes, parquet_file = input_files._footer_bytes, pq.ParquetFile

    def counted_footer(filesystem, uri):
        reads.append(uri)
        return footer_bytes(filesystem, uri)

    def counted_open(source, *args, metadata=None, **kwargs):
        if metadata is None:  # pyarrow reads the footer itself
            reads.append(str(source))
        return parquet_file(source, *args, metadata=metadata, **kwargs)

    monkeypatch.setattr(input_files, "_footer_bytes", counted_footer)
    monkeypatch.setattr(pq, "ParquetFile", counted_open)
    plan = plan_of(tmp_path / "in", shard_size=4)
    assert sorted(reads) == sorted(str(tmp_path / "in" / f"{n}.parquet") for n in "abc")
    monkeypatch.undo()
    for identity in plan.inputs:  # what reading the footer on its own gives
        assert identity.footer_sha256 == input_files.footer_sha256(LOCAL, identity.uri)
    assert plan.warnings == () and plan.total_rows == 120
