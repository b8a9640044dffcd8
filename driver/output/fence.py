"""Fencing: before `_SUCCESS`, make sure no worker actor of the job can still write.

`ray.kill` is asynchronous: the GCS marks the actor dead at once and asks its node to end the
process, which may still be uploading for a moment (or longer, if its node is cut off). The
driver therefore waits, after dispatch, until every actor it started is not only DEAD in the
GCS but its process is gone: on the driver's own node it looks at the pid; on another node a
zero-CPU task pinned there looks; a node the GCS reports dead took its processes with it (its
raylet's workers exit when the raylet goes). A zombie (exited, not yet reaped) counts as gone.

This is the second line of defence. The first needs no cooperation from Ray: every run of a
shard writes only keys carrying its own attempt token (workers.output.layout), and the manifest is
written create-only, so even a process that outlives this wait (a node partitioned from the
GCS) can only add objects no committed manifest names: orphans that `ditfleet verify` reports
as harmless and `--clean` deletes. It cannot change a committed object.
"""

from __future__ import annotations

# Ray is imported inside the functions that use it: `ditfleet validate` and `plan` import this
# module (for its types) and must not pay for loading Ray.
import os
import socket
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from ditfleet.driver.actor_phases import actor_id


def process_gone(pid: int) -> bool:
    """True when no live process has this pid on this machine (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 3 is the state; the command name before it (in parentheses) may hold spaces.
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:
        pass
    try:  # no /proc (macOS): signal 0 only checks that the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _gone_on_this_node(pids: Sequence[int]) -> list[bool]:
    return [process_gone(p) for p in pids]


def _local_addresses() -> set[str]:
    import ray

    addresses = {"127.0.0.1"}
    try:
        addresses.add(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - only narrows which pids are checked locally
        pass
    try:
        addresses.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    return addresses


def wait_actors_gone(handles: Iterable[Any], timeout_s: float = 60.0, poll_s: float = 0.2) -> list[str]:
    """Wait until every actor in `handles` (already killed) has no live process left.

    Returns the ids of the actors not confirmed gone within `timeout_s` (empty: all gone).
    """
    import ray
    from ray._private import state  # the GCS actor table: state and pid, no dashboard needed

    pending = {actor_id(h) for h in handles}
    if not pending:
        return []
    local = _local_addresses()
    remote_check = ray.remote(num_cpus=0, max_retries=0)(_gone_on_this_node)
    deadline = time.monotonic() + timeout_s
    while pending:
        try:
            alive_nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - the GCS did not answer: ask again
            alive_nodes = None
        if alive_nodes is None:
            if time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
            continue
        on_node: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for actor in list(pending):
            try:
                info = state.actors(actor) or {}
            except Exception:  # noqa: BLE001 - the GCS did not answer: not confirmed, ask again
                continue
            if info.get("State") != "DEAD":
                continue
            node, pid = (info.get("Address") or {}).get("NodeID"), int(info.get("Pid") or 0)
            if not pid or node is None or node not in alive_nodes:
                pending.discard(actor)  # never started a process, or its node is gone
                continue
            if alive_nodes[node].get("NodeManagerAddress") in local:
                if process_gone(pid):
                    pending.discard(actor)
            else:
                on_node[node].append((actor, pid))
        if on_node:
            left = deadline - time.monotonic()
            pending -= _gone_on_other_nodes(remote_check, on_node, max(min(left, 10.0), 0.1))
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return sorted(pending)


def _gone_on_other_nodes(
    remote_check: Any, on_node: dict[str, list[tuple[str, int]]], timeout_s: float
) -> set[str]:
    """Ask a zero-CPU task on each node whether the pids of its actors are gone; returns the
    actors confirmed gone within `timeout_s` (on_node: node id -> [(actor id, pid)])."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    refs = {
        remote_check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            [pid for _, pid in entries]
        ): entries
        for node, entries in on_node.items()
    }
    confirmed: set[str] = set()
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            gone = ray.get(ref)
        except Exception:  # noqa: BLE001 - the node died meanwhile: its processes with it
            gone = [True] * len(refs[ref])
        confirmed.update(actor for (actor, _), g in zip(refs[ref], gone) if g)
    return confirmed
