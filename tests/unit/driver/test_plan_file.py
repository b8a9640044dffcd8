"""A rerun reads the plan from `_plan.parquet` instead of scanning every row again, but only when
the input (as its footers say) and the settings give the same plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import ditfleet.driver.input.scan as scan_module
from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.plan import PlanConfig, plan_job
from ditfleet.driver.plan_file import PLAN_KEY, load_plan, save_plan
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import open_store

CONFIG = PlanConfig(rows=RowConfig(buckets=default_buckets("tiny")), shard_size=10)


def _input(root: Path) -> str:
    for f in range(3):
        n = 25 + f
        pq.write_table(
            pa.table(
                {
                    "id": [f"{f}-{i}" for i in range(n)],
                    "prompt": [f"thing {i}" for i in range(n)],
                    "width": [96 if i % 3 else None for i in range(n)],
                    "height": [160 if i % 3 else None for i in range(n)],
                    "num_images": [1 + i % 2 for i in range(n)],
                }
            ),
            root / f"part-{f}.parquet",
        )
    return str(root)


def test_a_rerun_loads_the_stored_plan_without_reading_rows(tmp_path: Path, monkeypatch):
    (tmp_path / "in").mkdir()
    source = PromptSource(_input(tmp_path / "in"))
    store = open_store(str(tmp_path / "out"))
    plan = plan_job(source, CONFIG)
    assert load_plan(store, source, CONFIG) is None  # nothing stored yet
    save_plan(store, plan)
    assert store.exists(PLAN_KEY)

    read = []
    real = scan_module.iter_batches
    monkeypatch.setattr(scan_module, "iter_batches", lambda *a, **k: read.append(1) or real(*a, **k))
    loaded = load_plan(store, PromptSource(str(tmp_path / "in")), CONFIG)
    assert loaded is not None and not read
    assert loaded.shards == plan.shards
    assert loaded.fingerprint() == plan.fingerprint()
    assert (loaded.total_rows, loaded.total_images, loaded.buckets_used) == (
        plan.total_rows,
        plan.total_images,
        plan.buckets_used,
    )
    assert loaded.bucket_usage == plan.bucket_usage


def test_other_settings_or_a_changed_file_plan_again(tmp_path: Path):
    (tmp_path / "in").mkdir()
    source = PromptSource(_input(tmp_path / "in"))
    store = open_store(str(tmp_path / "out"))
    save_plan(store, plan_job(source, CONFIG))
    assert (
        load_plan(store, PromptSource(str(tmp_path / "in")), dataclasses.replace(CONFIG, shard_size=7))
        is None
    )
    pq.write_table(pa.table({"id": ["x"], "prompt": ["a new row"]}), tmp_path / "in" / "part-1.parquet")
    assert load_plan(store, PromptSource(str(tmp_path / "in")), CONFIG) is None
    (tmp_path / "in" / "part-3.parquet").write_bytes(b"not parquet")
    assert load_plan(store, PromptSource(str(tmp_path / "in")), CONFIG) is None


def test_a_damaged_plan_file_is_ignored(tmp_path: Path):
    (tmp_path / "in").mkdir()
    source = PromptSource(_input(tmp_path / "in"))
    store = open_store(str(tmp_path / "out"))
    store.put(PLAN_KEY, b"PAR1 half a file")
    assert load_plan(store, source, CONFIG) is None
