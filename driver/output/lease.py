"""One driver at a time owns an output: a lease object, written create-only, with an expiry.

    {out}/_lease/{generation:08d}.json   {"owner", "host", "pid", "acquired_at", "expires_at", "released",
                                          "shards": [[lo, hi], ...], "redo": {"<shard>": g}, "settled"}

The driver holding the highest generation owns the output while its lease has not expired (or
been released). To take the output, a driver writes the next generation create-only: of two
drivers that try at once, one wins and the other is refused (`OutputBusy`). A lease that
expired (its driver crashed, or lost the store for longer than the lease) is taken over the
same way, so a crashed driver blocks the next run for at most `ttl_s`, and not at all from the
machine it ran on (its process is seen to be gone). The holder renews its own
generation every `ttl_s / 4` from a background thread; before each write that only the owner
may make (deleting orphans, `_SUCCESS`) it calls `check`, which refuses once a higher generation
exists or its own lease ran out. Expiry is wall-clock time: drivers sharing an output need
clocks within a fraction of `ttl_s` of each other (NTP gives milliseconds).

The lease keeps two live drivers from doing the same work at once; it is not what makes any
deletion or commit safe (docs/reliability.md): a driver paused past its lease that resumes acts
on a stale view, and every rule it then follows holds anyway. Deletion follows the one rule of
driver.output.orphans, which needs no lock; a `_SUCCESS` carries the lease generation that wrote
it and is stale, for every reader of ours, once a higher generation exists (driver.output.success).

The document also says, for whoever comes after a crash, what its run dispatches ("shards" as
ranges, "redo" generations; `record_work`, before any is dispatched) and "settled" once its
finish cleaned up. A later driver settles older documents, then deletes them
(driver.output.settle); the highest document is never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ditfleet.driver.output.fence import process_gone
from ditfleet.driver.output.job_file import OutputMismatch
from ditfleet.driver.output.json_objects import read_json
from ditfleet.workers.output.layout import LEASE_PREFIX, lease_key, lease_of_key
from ditfleet.workers.storage import ObjectStore

log = logging.getLogger(__name__)

LEASE_TTL_S = 120.0
_TRIES = 5  # takes of the next generation lost to other drivers before giving up


class OutputBusy(OutputMismatch):
    """Another driver owns the output now (its lease is current)."""


def lease_generations(store: ObjectStore) -> list[int]:
    """The lease generations present, lowest first."""
    return sorted(g for g in map(lease_of_key, store.list(LEASE_PREFIX)) if g is not None)


class OutputLease:
    """A held lease; `release` (or leaving the `with` block) gives the output back."""

    def __init__(
        self,
        store: ObjectStore,
        generation: int,
        doc: dict[str, Any],
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.generation, self.ttl_s, self._clock = store, generation, ttl_s, clock
        self._doc = doc
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return lease_key(self.generation)

    @property
    def expires_at(self) -> float:
        return float(self._doc["expires_at"])

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="ditfleet-output-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried; check() says if it lapsed
                log.warning("could not renew the lease on %s: %s", self.store.uri(self.key), e)
            if self._lost is not None:
                return

    def _taken_over(self) -> int | None:
        higher = [g for g in lease_generations(self.store) if g > self.generation]
        return higher[0] if higher else None

    def _note_takeover(self) -> None:
        if self._lost is None and (other := self._taken_over()) is not None:
            self._lost = f"another driver took the output (lease generation {other})"

    def _write(self, **changes: Any) -> None:
        doc = {**self._doc, **changes}
        self.store.put(self.key, _encode(doc), "application/json")
        self._doc = doc

    def renew(self) -> None:
        """Extend the lease by ttl_s, unless another driver took the output."""
        with self._lock:
            self._note_takeover()
            if self._lost is None:
                self._write(expires_at=self._clock() + self.ttl_s)

    def record_work(self, shards: Iterable[int], redo: Mapping[int, int]) -> None:
        """Write, durably, the shards this run dispatches and the redo generations it commits,
        before any is dispatched: a driver that takes the output after this one seals those
        generations and cleans those shards. Raises OutputBusy when the output was taken."""
        self.check()  # a released or lost lease's document is not written again
        with self._lock:
            self._write(shards=shard_ranges(shards), redo={str(s): int(g) for s, g in sorted(redo.items())})
        self.check()  # after the write: a driver taking over later reads what it says

    def mark_settled(self) -> None:
        """This run's finish cleaned up its shards: a later driver need not settle this document."""
        with self._lock:
            if self._lost is None and not self._doc.get("settled"):
                self._write(settled=True)

    def check(self) -> None:
        """Raise OutputBusy unless this driver still owns the output."""
        with self._lock:
            self._note_takeover()
            if self._lost is None and self._clock() >= self.expires_at:
                self._lost = "this driver's lease ran out before it could be renewed"
            if self._lost is not None:
                raise OutputBusy(
                    f"output {self.store.uri()}: {self._lost}; this run stops writing to it. Run one "
                    "`ditfleet run` of an output at a time"
                )

    def release(self) -> None:
        """Stop renewing and mark the lease released, so the next run need not wait."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._lost is not None:
                return
            try:
                if self._taken_over() is None:
                    self._write(released=True, expires_at=self._clock())
            except Exception as e:  # noqa: BLE001 - the lease then expires on its own
                log.warning("could not release the lease on %s: %s", self.store.uri(self.key), e)
            self._lost = "the lease was released"

    def __enter__(self) -> OutputLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _encode(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def _describe(doc: dict[str, Any] | None, now: float) -> str:
    if doc is None:
        return "a lease that cannot be read"
    left = max(0.0, float(doc.get("expires_at", 0)) - now)
    return (
        f"driver {doc.get('owner')} on {doc.get('host')} (pid {doc.get('pid')}), since "
        f"{doc.get('acquired_at')}; its lease expires in {left:.0f} s unless it renews it"
    )


def _process_space() -> str | None:
    """Which set of process ids this process sees: the machine's boot and its pid namespace. Two
    drivers that print the same value see the same processes, so one can ask whether the other
    is alive; a hostname alone does not say that (containers may share one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None  # not Linux: only expiry frees a lease


def this_process() -> dict[str, Any]:
    """This process as a lease document names its holder: what `holder_is_gone` reads."""
    return {"pid": os.getpid(), "process_space": _process_space()}


def holder_is_gone(doc: dict[str, Any]) -> bool:
    """The lease's driver ran in this process space and its process has exited (it crashed, or
    was killed): its lease need not be waited out. A reused pid only makes us wait out the lease."""
    space, pid = doc.get("process_space"), doc.get("pid")
    if space is None or space != _process_space() or not isinstance(pid, int) or pid == os.getpid():
        return False
    return process_gone(pid)


def _current(store: ObjectStore, generation: int, now: float) -> dict[str, Any] | None:
    """The lease document of `generation` when it is still held, else None: not released, not
    expired, and its driver not known to be gone. A document that is not JSON this code wrote
    cannot hold the output."""
    doc = read_lease_document(store, generation)
    if doc is None or doc.get("released"):
        return None
    try:
        if float(doc.get("expires_at", 0)) <= now:
            return None
    except (TypeError, ValueError):
        return None
    return None if holder_is_gone(doc) else doc


def acquire_lease(
    store: ObjectStore,
    ttl_s: float = LEASE_TTL_S,
    *,
    renew: bool = True,
    clock: Callable[[], float] = time.time,
    keeps_complete: bool = False,
    compacts: bool = False,
) -> OutputLease:
    """Take the output for this driver, or raise OutputBusy naming the driver that has it.
    renew: keep the lease alive from a background thread until `release`. keeps_complete: the
    holder is a tool that leaves a complete output complete (`ditfleet compact`, `verify
    --clean`): its lease does not make the output's `_SUCCESS` stale (driver.output.success).
    compacts: the holder writes the compacted set (`ditfleet compact`): a driver that takes the
    output from it while it is not released fences its set (driver.output.compact)."""
    for _ in range(_TRIES):
        generations = lease_generations(store)
        now = clock()
        if generations:
            top = generations[-1]
            held = _current(store, top, now)
            if held is not None:
                raise OutputBusy(
                    f"output {store.uri()} is being written by another `ditfleet run`: "
                    f"{_describe(held, now)}. One driver at a time owns an output: wait for that run "
                    f"to end, or, if it crashed, for its lease ({store.uri(lease_key(top))}) to expire"
                )
            generation = top + 1
        else:
            generation = 0
        doc = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            **this_process(),
            "acquired_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "expires_at": now + ttl_s,
            "released": False,
            "shards": [],
            "redo": {},
            "settled": False,
            "keeps_complete": keeps_complete,
            "compacts": compacts,
        }
        if store.put_if_absent(lease_key(generation), _encode(doc), "application/json"):
            lease = OutputLease(store, generation, doc, ttl_s, clock)
            if renew:
                lease.start_renewing()
            return lease
    raise OutputBusy(
        f"output {store.uri()}: {_TRIES} other drivers took its lease first; is another `ditfleet run` "
        "of this output starting? Run one at a time"
    )


def read_lease_document(store: ObjectStore, generation: int) -> dict[str, Any] | None:
    """A lease document, or None when it is gone or is not JSON this code wrote."""
    try:
        return read_json(store, lease_key(generation))
    except ValueError:
        return None


def shard_ranges(shards: Iterable[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 2], [5, 5]]: a run's shards in a lease document, compact at 400,000."""
    out: list[list[int]] = []
    for s in sorted(set(shards)):
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def shards_of_ranges(ranges: Any) -> set[int] | None:
    """The shards of `shard_ranges`' form; None when it is not that form (a document of an
    earlier version, which did not record them: its run may have touched any shard)."""
    if not isinstance(ranges, list):
        return None
    out: set[int] = set()
    for pair in ranges:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) for v in pair)):
            return None
        out.update(range(pair[0], pair[1] + 1))
    return out
