"""Compile each bucket once per machine: actors that start together claim buckets, not cores.

Actors starting at the same time on one machine would each compile the same resolution buckets
on the same cores. Instead, before warming a bucket an actor takes an exclusive file lock named
by the bucket and the compile cache key, in the machine's Inductor cache directory:

- The first claimant compiles the bucket; Inductor's local caches (FX graph, AOTAutograd, the
  built C++ kernel libraries) fill as it does, and it releases the lock.
- Warm-up first goes through every bucket it can claim at once (so actors starting together
  split the buckets between them), then comes back to the ones another actor holds and waits
  for each. When the lock comes free its warm-up finds every graph in the local caches: Dynamo
  still traces (so its guards, and the no-recompile guarantee, are the actor's own), Inductor
  compiles nothing.
- A claimant that dies releases its lock with its process (the kernel drops flock locks), so a
  waiter takes over at once and compiles the bucket itself. A claimant that hangs holds it: the
  waiter gives up after `timeout_s`, says so loudly (CompileClaimWarning), and compiles anyway.

Across nodes the locks do not reach: an actor on another node loads what the first finisher
saved to the shared compile cache (compile.cache), or compiles itself when it starts alongside.
The lock files stay (empty); every later start reuses them.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

CLAIMS_DIR = "ditfleet_claims"  # under the Inductor cache directory


class CompileClaimWarning(RuntimeWarning):
    """A bucket's claimant held it past the timeout; this actor compiled it as well."""


@dataclass(frozen=True)
class ClaimOutcome:
    how: str  # "claimed" (compiled it) | "waited" (another compiled it) | "timeout" | "off"
    waited_s: float = 0.0


class BucketClaims:
    """Per-(compile key, bucket) locks in `root` (the machine's Inductor cache directory)."""

    def __init__(self, root: str | Path, key: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"claim timeout must be > 0 seconds, got {timeout_s}")
        self.dir = Path(root) / CLAIMS_DIR
        self.key = key
        self.timeout_s = float(timeout_s)

    def path(self, bucket: str) -> Path:
        digest = hashlib.sha256(f"{self.key}\0{bucket}".encode()).hexdigest()[:24]
        return self.dir / f"{bucket}-{digest}.lock"

    def compiled_before(self, bucket: str) -> bool:
        """Whether a process on this machine has claimed the bucket before (its lock file stays):
        then warm-up finds the bucket in the local compile cache and takes seconds, not a compile."""
        return self.path(bucket).exists()

    def _lock(self, bucket: str) -> FileLock:
        # filelock's FileLock is a flock on Unix: released when the holder's process ends.
        self.dir.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path(bucket)))

    def try_claim(self, bucket: str) -> FileLock | None:
        """The bucket's lock, held, if the bucket was free; None if another process holds it."""
        lock = self._lock(bucket)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return None
        return lock

    @contextmanager
    def hold(self, bucket: str, lock: FileLock | None = None) -> Iterator[ClaimOutcome]:
        """Hold the bucket's lock for the block: `lock` from try_claim, or wait for it (bounded)."""
        start = time.monotonic()
        how = "claimed" if lock is not None else "waited"
        if lock is None:
            lock = self._lock(bucket)
            try:
                lock.acquire(timeout=self.timeout_s)
            except Timeout:
                lock, how = None, "timeout"
                warnings.warn(
                    CompileClaimWarning(
                        f"bucket {bucket}: another process on this machine has been "
                        f"compiling it for {self.timeout_s:.0f} s (lock {self.path(bucket)}); "
                        "compiling it here as well. If that process is stuck, end it; "
                        "raise compile.claim_timeout_s if compiles are this slow."
                    ),
                    stacklevel=3,
                )
        try:
            yield ClaimOutcome(how, round(time.monotonic() - start, 3))
        finally:
            if lock is not None:
                lock.release()
