"""The worker's metrics, exported through Ray (`ray.util.metrics`) to the node's Prometheus
endpoint and the dashboard: images made (ok / failed) and per-image latencies.

Ray exports each metric with a `ray_` prefix (a counter also gets `_total`), tagged with the
node and worker; ours add the job's output URI (which data set), e.g.
`ray_ditfleet_images_total{status="ok",output="s3://b/ds",...}` and the histogram
`ray_ditfleet_image_seconds_bucket{stage="generate",...}`. Counts are recorded when a shard's
manifest is committed, so they add up to what the manifests hold (a losing duplicate attempt of a
shard is not counted). Outside a Ray worker (tests that run the worker in-process without Ray)
every call is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Seconds: from a small image on a fast GPU to a large one on a slow GPU or a slow upload.
LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250]
IMAGES = "ditfleet_images"
IMAGE_SECONDS = "ditfleet_image_seconds"
SHARDS = "ditfleet_worker_shards"
_STAGES = ("generate", "encode", "upload")


class WorkerMetrics:
    """Counters and histograms of one worker process. Created in the actor's __init__."""

    def __init__(self, output: str = "") -> None:
        self._tags = {"output": output}
        self._images: Any = None
        try:
            import ray

            if not ray.is_initialized():
                return
            from ray.util.metrics import Counter, Histogram
        except ImportError:
            return
        self._images = Counter(
            IMAGES, "Images stored and committed, by status (ok, failed)", ("output", "status")
        )
        self._seconds = Histogram(
            IMAGE_SECONDS,
            "Per-image time in seconds, by stage: generate (its share of the batch), encode, upload",
            LATENCY_BOUNDARIES,
            ("output", "stage"),
        )
        self._shards = Counter(SHARDS, "Shards this worker finished, by outcome", ("output", "outcome"))

    @property
    def enabled(self) -> bool:
        return self._images is not None

    def shard_finished(self, outcome: str, rows: Iterable[Any] = ()) -> None:
        """outcome: committed | already_committed | abandoned | failed. rows: the manifest rows of
        a committed shard (ManifestRow: status, generate_s, encode_s, upload_s)."""
        if not self.enabled:
            return
        self._shards.inc(1, {**self._tags, "outcome": outcome})
        ok = failed = 0
        for row in rows:
            if row.status == "ok":
                ok += 1
            else:
                failed += 1
            for stage in _STAGES:
                value = getattr(row, f"{stage}_s", None)
                if isinstance(value, (int, float)) and value >= 0:
                    self._seconds.observe(float(value), {**self._tags, "stage": stage})
        if ok:
            self._images.inc(ok, {**self._tags, "status": "ok"})
        if failed:
            self._images.inc(failed, {**self._tags, "status": "failed"})
