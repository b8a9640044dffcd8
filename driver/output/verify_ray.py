"""`ditfleet verify OUT --ray`: verify's per-shard checks as Ray tasks, for outputs larger than
one machine's threads hash in reasonable time.

Each task opens the store itself from the output's URI and S3 settings and runs verify's own
per-shard functions (driver.output.verify_shards) on a group of shards or objects; everything
else stays in driver.output.verify, so the report is the one threads give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ditfleet.workers.storage import ObjectStore, S3Config, open_store

TASKS_PER_CPU = 4  # groups per cluster CPU: a slow node's group is a small part of the work


def _on_store(check: Callable[..., list], uri: str, s3: S3Config | None, items: list, *args: Any) -> list:
    return check(open_store(uri, s3), items, *args)


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

    def run(self, check: Callable[..., list], store: ObjectStore, items: list, *args: Any) -> list:
        """One task per group of `items`, each on its own store; `args` are put once for all
        tasks (an incremental plan has every shard's counts)."""
        import ray

        if not items:
            return []
        task = ray.remote(num_cpus=1)(_on_store)
        refs = [ray.put(a) for a in args]
        parts = [
            task.remote(check, self.uri, self.s3, group, *refs, self.threads)
            for group in task_groups(items, self.groups)
        ]
        return [found for part in ray.get(parts) for found in part]
