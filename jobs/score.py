"""`ditfleet score OUT --scorer NAME`: score an existing output's images into side tables that
readers join, never touching a committed manifest or image.

One table per current shard manifest (workers.output.score_table), made in threads here or in Ray
tasks over a cluster (`--ray`). Resumable: a manifest whose table exists is skipped, so a killed
run goes on where it stopped. Never silently stale: a table is named after the manifest
generation it was made from and joins on the image's id, k and uri (the uri is the generation's
object, which a redo changes; the id and k tell apart the images of a "parquet" or "webdataset"
shard, which share one uri); a redo does not rescore, and `ditfleet status`, `preview` and
`report` name the shards it left without a current table (score_table.ScoreTables); a table whose
manifest is no longer current (a redo committed a higher generation since) is one this command
wrote and can prove superseded, so it is deleted before the missing tables are made. Reading
the scores next to the manifests (DuckDB, pyarrow): docs/quality.md.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ditfleet.driver.output.job_file import read_job_file
from ditfleet.model.quality.table import SCORER_NAMES, scorer_row
from ditfleet.workers.contract import MODEL_CACHE_DIR
from ditfleet.workers.output.layout import SCORES_PREFIX, manifest_of_key, manifest_of_score_table
from ditfleet.workers.output.manifest import current_manifest_keys
from ditfleet.workers.storage import ObjectStore, S3Config, open_store

if TYPE_CHECKING:  # torch: the CLI starts without it
    from ditfleet.workers.scorers import ScorerSource


@dataclass
class ScoreReport:
    """What one `ditfleet score` run did."""

    scorer: str
    manifests: int = 0  # current shard manifests of the output
    already: int = 0  # of them with a table before this run
    scored: list[str] = field(default_factory=list)  # manifests scored now
    images: int = 0  # images scored now
    stale_deleted: list[str] = field(default_factory=list)  # tables of superseded generations
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "scorer": self.scorer,
            "manifests": self.manifests,
            "already": self.already,
            "scored": len(self.scored),
            "images": self.images,
            "stale_deleted": self.stale_deleted,
            "seconds": round(self.seconds, 3),
            "tables": f"{SCORES_PREFIX}{self.scorer}/",
        }

    def format_text(self, root: str) -> str:
        lines = [
            f"scores {self.scorer}: {self.already + len(self.scored)}/{self.manifests} shard manifests "
            f"scored ({len(self.scored)} now, {self.images} images, {self.seconds:.1f} s; "
            f"{self.already} before)",
            f"tables: {root.rstrip('/')}/{SCORES_PREFIX}{self.scorer}/ (join on id, k and uri with the manifests: docs/quality.md)",
        ]
        if self.stale_deleted:
            lines.append(
                f"deleted {len(self.stale_deleted)} table(s) of superseded generations (a redo committed since)"
            )
        return "\n".join(lines)


def _score_task(uri: str, s3: S3Config | None, manifests: list[str], source: ScorerSource) -> list[int]:
    from ditfleet.workers.output.score_table import write_score_table

    store = open_store(uri, s3)
    scorer = source.build()
    return [write_score_table(store, m, scorer) for m in manifests]


def scorer_source(
    store: ObjectStore,
    scorer: str,
    *,
    model_path: str | None = None,
    scorer_model: str | None = None,
    s3: S3Config | None = None,
) -> ScorerSource:
    """`scorer` with its models: model_path, the model whose text encoder `vqa` asks (default: the
    one the output's job used); scorer_model, the model of a scorer with a model of its own, as
    `clip` (default: the job's setting its row names, quality.clip_model). Either, when remote, is fetched through `s3` into the job's
    model.cache_dir (without a `_job.json`, the default one)."""
    from ditfleet.workers.scorers import ScorerSource

    job = (read_job_file(store) or {}).get("spec", {})
    setting = scorer_row(scorer).setting if scorer in SCORER_NAMES else None
    return ScorerSource(
        scorer,
        model_path=model_path or job.get("model", {}).get("path"),
        scorer_model=scorer_model or (job.get("quality", {}).get(setting) if setting else None),
        # A remote model lands where the job's actors put theirs: on a node that ran the job, the
        # copy is there already and nothing is fetched again.
        cache_dir=job.get("model", {}).get("cache_dir") or MODEL_CACHE_DIR,
        s3=s3,
    )


def score_output(
    store: ObjectStore,
    source: ScorerSource,
    *,
    workers: int = 2,
    use_ray: bool = False,
    ray_s3: S3Config | None = None,
) -> ScoreReport:
    """Make the missing score tables of `source` for every current manifest of the output: in
    `workers` threads here, or with `use_ray` in Ray tasks that open the output with `ray_s3`."""
    source.check()  # a wrong name or a missing model fails before any work
    start = time.perf_counter()
    report = ScoreReport(source.name)
    by_shard = current_manifest_keys(store)  # listed before the tables: see _existing_tables
    current = set(by_shard.values())
    report.manifests = len(current)
    made, report.stale_deleted = _existing_tables(store, source.name, by_shard)
    report.already = len(made)
    report.scored = sorted(current - made)
    counts: list[int] = []
    if use_ray:
        import ray

        from ditfleet.driver.output.verify_ray import task_groups

        task = ray.remote(num_cpus=1)(_score_task)
        refs = [task.remote(store.uri(), ray_s3, group, source) for group in task_groups(report.scored)]
        counts = [n for part in ray.get(refs) for n in part]
    elif report.scored:
        from ditfleet.workers.output.score_table import write_score_table

        scorer = source.build()  # once: a model-based scorer's weights load once, its threads share them
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            counts = list(pool.map(lambda m: write_score_table(store, m, scorer), report.scored))
    report.images = sum(counts)
    report.seconds = time.perf_counter() - start
    return report


def _existing_tables(store: ObjectStore, scorer: str, by_shard: dict[int, str]) -> tuple[set[str], list[str]]:
    """The current manifests (`by_shard`: shard -> manifest) that have a table of `scorer`
    already, and the tables of superseded generations, which are deleted."""
    current = set(by_shard.values())
    made: set[str] = set()
    deleted: list[str] = []
    for key in store.list(f"{SCORES_PREFIX}{scorer}/"):
        manifest = manifest_of_score_table(scorer, key)
        if manifest is None:
            continue  # not a table of ours: left alone
        if manifest in current:
            made.add(manifest)
            continue
        # Deleted only when provably superseded: a lower generation than the shard's current one.
        # A higher one committed after `by_shard` was listed (another run may have scored it) stays.
        shard, generation = manifest_of_key(manifest) or (-1, -1)
        seen = manifest_of_key(by_shard[shard]) if shard in by_shard else None
        if seen is not None and generation < seen[1]:
            store.delete(key)
            deleted.append(key)
    return made, deleted
