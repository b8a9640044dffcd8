"""`ditfleet verify OUT --ray`: verify's per-shard checks as Ray tasks, for outputs larger than
one machine's threads hash in reasonable time.

Only where the per-shard work runs changes: each task opens the store itself from the output's
URI and S3 settings, runs verify's own per-shard functions (driver.output.verify_shards) on a
group of shards or objects and returns their findings in order; the driver lists the output and
does every whole-output check (a row in two manifests, orphans and strays, `_SUCCESS`, the
compacted set) and any `--clean` deletion itself, exactly as with threads. So the report is the
one `verify_output` gives on threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ditfleet.driver.output.verify_shards import check_object_group, read_manifest_group
from ditfleet.workers.storage import S3Config, open_store

TASKS_PER_CPU = 4  # groups per cluster CPU: a slow node's group is a small part of the work


def _read_task(uri: str, s3: S3Config | None, items: list, plan: Any, threads: int) -> list:
    return read_manifest_group(open_store(uri, s3), items, plan, threads)


def _check_task(uri: str, s3: S3Config | None, items: list, threads: int) -> list:
    return check_object_group(open_store(uri, s3), items, threads)


def task_groups(items: list, groups: int | None = None) -> list[list]:
    """`items` cut into about `groups` runs in order (default: TASKS_PER_CPU per CPU of the
    cluster this process is connected to), one Ray task each."""
    if groups is None:
        import ray

        groups = max(1, int(ray.cluster_resources().get("CPU", 1)) * TASKS_PER_CPU)
    size = max(1, -(-len(items) // max(1, groups)))
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass
class RayChecks:
    """verify_output(shard_checks=RayChecks(uri, s3)) on the Ray cluster this process is
    connected to. `groups`: tasks per phase (default: TASKS_PER_CPU per cluster CPU);
    `threads`: threads inside each task (reading and hashing wait on the store)."""

    uri: str
    s3: S3Config | None = None
    groups: int | None = None
    threads: int = 4

    def read_manifests(self, store, items, plan):
        import ray

        if not items:
            return []
        task = ray.remote(num_cpus=1)(_read_task)
        plan_ref = ray.put(plan)  # once for all tasks: an incremental plan has every shard's counts
        refs = [
            task.remote(self.uri, self.s3, group, plan_ref, self.threads)
            for group in task_groups(items, self.groups)
        ]
        return [found for part in ray.get(refs) for found in part]

    def check_objects(self, store, items):
        import ray

        if not items:
            return []
        task = ray.remote(num_cpus=1)(_check_task)
        refs = [
            task.remote(self.uri, self.s3, group, self.threads) for group in task_groups(items, self.groups)
        ]
        return [found for part in ray.get(refs) for found in part]


__all__ = ["RayChecks", "task_groups"]
