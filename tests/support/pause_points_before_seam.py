"""The driver's pause points on a checkout from before the seam (INTEGRITY.md section 8), placed
by wrapping the function that ran at each moment there, and its lease length from
`DITFLEET_LEASE_TTL_S`. Installed by tests/support/fence_entry.py only when the project has no
`ditfleet.driver.output.pause_points`, so the same tests run, and show what they show, on the
code before the fence (how each scenario failed there is in the commit that added them).

| point                 | before the seam: the moment it stands for                                   |
| --------------------- | --------------------------------------------------------------------------- |
| after_lease_check     | finish: the lease was checked, `clean_orphans` is about to run               |
| in_cleanup            | `shard_orphans` read the shard's manifest; the listing of its objects is next |
| before_success        | the clean-up is done, `write_success` is about to run                        |
| verify_before_delete  | `verify --clean` read the manifests; it lists, then deletes, next             |
| after_dispatch_start / after_redo_commit | placed by the in-process dispatch (fence_entry), as on the seam |
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from tests.support.pause_seam import stop_point


def _before(module: Any, name: str, point: str, once: bool = False) -> None:
    original: Callable = getattr(module, name)
    fired = []

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (once and fired):
            fired.append(True)
            stop_point(point)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def install() -> None:
    import ditfleet.driver.output.finish as finish
    import ditfleet.driver.output.lease as lease
    import ditfleet.driver.output.orphans as orphans
    import ditfleet.driver.output.verify as verify

    _before(finish, "clean_orphans", "after_lease_check")
    _before(orphans, "losing_run_keys", "in_cleanup", once=True)
    _before(finish, "write_success", "before_success")
    _before(verify, "_check_objects", "verify_before_delete")
    ttl = os.environ.get("DITFLEET_LEASE_TTL_S")
    if ttl:
        lease.acquire_lease.__defaults__ = (float(ttl),)
