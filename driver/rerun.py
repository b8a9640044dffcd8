"""A run of an output that already holds committed shards: which manifest generation each shard
named by `--redo-shards` commits, and whether a complete output (its `_SUCCESS` there) still holds
every object its manifests name. Both only list and read; neither writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TextIO

from ditfleet.driver.output.orphans import missing_named_objects
from ditfleet.driver.output.summary import FAILED, JobSummary
from ditfleet.workers.output.layout import MANIFESTS_PREFIX
from ditfleet.workers.output.manifest import manifest_generations
from ditfleet.workers.rows import ShardSpec
from ditfleet.workers.storage import ObjectStore


class RedoError(ValueError):
    """Shards asked to be redone that cannot be: not in the plan, or not committed yet."""


def redo_generations(
    store: ObjectStore, shards: Sequence[ShardSpec], committed: set[int], redo: Sequence[int]
) -> dict[int, int]:
    """Shard -> the manifest generation its redo commits: one above the highest generation
    present (seals and tombstones included: a sealed generation can never commit).

    Only committed shards of the plan can be redone (an uncommitted one runs on a plain rerun).
    The generation is read from the listing now; two runs of one redo (a retry, a speculative
    twin) commit the same generation create-only, so the first wins as for any commit.
    """
    if not redo:
        return {}
    planned = {s.index for s in shards}
    unknown = sorted(set(redo) - planned)
    if unknown:
        raise RedoError(
            f"--redo-shards: shards {unknown} are not in the job's plan (it has shards 0..{len(shards) - 1})"
        )
    pending = sorted(set(redo) - committed)
    if pending:
        raise RedoError(
            f"--redo-shards: shards {pending} are not committed yet; run the job without --redo-shards "
            "to run them"
        )
    listed = manifest_generations(store.list(MANIFESTS_PREFIX))
    return {shard: max(listed[shard]) + 1 for shard in sorted(set(redo))}


def complete_already(store: ObjectStore, previous: JobSummary, done: int, out: TextIO) -> JobSummary:
    """A rerun of a complete output: check, by listing alone, that every object its manifests
    name is still there; the summary in `_SUCCESS` when it is, a failed one naming the shards
    whose objects are gone when not."""
    lost = missing_named_objects(store)
    if not lost:
        print(
            f"{store.uri()}: already complete ({done} shards committed, every object they name "
            "is there); nothing to do",
            file=out,
        )
        # _SUCCESS names where the output was written; a copied or moved output is here now.
        return dataclasses.replace(previous, output=store.uri())
    shards = sorted(lost)
    count = sum(len(keys) for keys in lost.values())
    print(
        f"{store.uri()}: _SUCCESS is there, but {count} objects its manifests name are missing, in "
        f"shards {shards[:20]}{' ...' if len(shards) > 20 else ''} (e.g. {lost[shards[0]][0]}). "
        "A committed manifest is never rewritten: restore the objects (from a backup or a versioned "
        f"bucket), or redo these shards under new attempts with `ditfleet run JOB --redo-shards "
        f"{','.join(map(str, shards))}` (each commits a new manifest generation that supersedes its "
        "old one; the other shards are left as they are). `ditfleet verify` lists every problem",
        file=out,
    )
    return dataclasses.replace(previous, status=FAILED)
