"""Helpers for worker-level tests: prompt Parquet files, shard specs and worker configs. Torch-free,
so tests of the driver and CLI can use it. Outputs written by hand with their manifest rows are
`ditfleet.testing.outputs` (bench/ uses them too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.workers.contract import WorkerConfig
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.rows import RowConfig, ShardSpec
from ditfleet.workers.storage import S3Config

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
SMALL_BUCKETS = ("32x32", "48x32")


def write_prompts(
    path: Path, n: int, sizes: bool = True, extra: bool = True, row_group_size: int = 64
) -> Path:
    """n prompts, some with their own size and seed, plus a pass-through column."""
    data: dict[str, list] = {
        "id": [f"p{i:05d}" for i in range(n)],
        "prompt": [
            f"a small {COLOURS[i % 4]} {SHAPES[i % 3]} at the top left on a white background"
            for i in range(n)
        ],
    }
    if sizes:
        data["width"] = [48 if i % 3 == 0 else None for i in range(n)]
        data["height"] = [32 if i % 3 == 0 else None for i in range(n)]
        data["seed"] = [1000 + i if i % 5 == 0 else None for i in range(n)]
    if extra:
        data["source"] = [f"batch-{i % 7}" for i in range(n)]
    table = pa.table(data)
    if sizes:
        table = table.set_column(
            table.schema.get_field_index("seed"), "seed", pa.array(data["seed"], pa.int64())
        )
        for name in ("width", "height"):
            table = table.set_column(
                table.schema.get_field_index(name), name, pa.array(data[name], pa.int32())
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def row_config(steps: int = 2, cfg: float = 4.0, buckets: tuple[str, ...] = SMALL_BUCKETS) -> RowConfig:
    return RowConfig(job_seed=7, buckets=BucketSet.from_names(buckets), steps=steps, true_cfg_scale=cfg)


def shard_of(
    path: Path, index: int, start: int, stop: int, buckets: tuple[str, ...] = SMALL_BUCKETS
) -> ShardSpec:
    return ShardSpec(
        index=index,
        file=str(path),
        row_start=start,
        row_stop=stop,
        position_start=start,
        buckets_used=buckets,
        num_images=stop - start,
    )


def worker_config(
    model_dir: Path | str,
    output_uri: str,
    s3: S3Config | None = None,
    rows: RowConfig | None = None,
    output_format: str = "files",
    batch_size: int = 4,
    **writer: object,
) -> WorkerConfig:
    return WorkerConfig(
        output_uri=output_uri,
        rows=rows or row_config(),
        model_path=str(model_dir),
        batch_size=batch_size,
        compile=CompileConfig(vae=False, dit=False),
        writer=ShardWriterConfig(output_format=output_format, threads=4, max_in_flight=8, **writer),  # type: ignore[arg-type]
        s3=s3 or S3Config(),
    )


def finish_like_driver(store: Any, plan: Any, out: Any = None) -> None:
    """The driver's end of a run, as `run_job` does it (driver.output.finish): count the shards, clean
    up, write `_SUCCESS`; what it prints goes to `out` (a text stream; None: nowhere).

    For tests that run shards on the real worker without a Ray cluster; every planned shard must
    be committed (a shard of `plan` with a generation >= 1 is a redo's).
    """
    import io
    import time

    from ditfleet.driver.output.finish import finish_run
    from ditfleet.driver.output.summary import RunOutcome
    from ditfleet.driver.progress import JobProgress

    n = len(plan.shards)
    planned = {"shards": n, "rows": plan.total_rows, "images": plan.total_images}
    progress = JobProgress(
        total_shards=n, total_images=plan.total_images, stream=io.StringIO(), interactive=False
    )
    run = RunOutcome(plan.shards, frozenset(), plan.fingerprint(), planned, None, progress, {})
    summary = finish_run(store, run, started=time.monotonic(), out=out or io.StringIO())
    assert summary.shards["left"] == 0, f"finish_like_driver: {summary.shards['left']} shards not committed"
