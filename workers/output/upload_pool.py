"""A bounded pool of encode+upload threads: memory stays flat however large the shard.

At most `max_in_flight` tasks are held at once (each holds one image); `submit` blocks until a
slot frees, which is what makes the generator wait when storage is the bottleneck. A task that
raises means its image could not be stored (after the store's own retries): the pool stops
taking work and `drain` raises, so the shard commits nothing. Per-image problems that should
fail only that row (an encode error) are the task's to catch and return as a result.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any


class ShardStoreError(RuntimeError):
    """Some image of the shard could not be stored; the shard must not be committed."""


@dataclass(frozen=True, kw_only=True)
class ImageResult:
    """What happened to one image. Times in seconds; `bytes` is the encoded size.

    `error` set = this row failed (e.g. non-finite output, encode error); the others are None.
    """

    id: str
    k: int
    uri: str | None = None
    sha256: str | None = None
    bytes: int | None = None
    encode_s: float | None = None
    upload_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class UploadPool:
    """Runs tasks on `threads` threads with at most `max_in_flight` of them held at once.
    Tasks are submitted from one thread (the shard's generator loop).

    ordered=False: a slot frees when its task finishes; results come back in submission order.
    ordered=True: a slot frees when `on_result` has consumed the task's value, and `on_result`
    sees values strictly in submission order (for writers that append to one file).
    `on_result` runs in the submitting thread and turns a task's value into an ImageResult.
    """

    def __init__(
        self,
        max_in_flight: int,
        threads: int,
        on_result: Callable[[Any], ImageResult] | None = None,
        ordered: bool = False,
    ) -> None:
        self._ordered = ordered
        self._on_result = on_result
        self._slots = threading.Semaphore(max_in_flight)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="ditfleet-upload")
        self._pending: collections.deque[tuple[int, str, Future[Any]]] = collections.deque()
        self._results: dict[int, ImageResult] = {}
        self._lock = threading.Lock()
        self._failures: list[tuple[str, BaseException]] = []
        self._submitted = 0
        self._closed = False

    def __enter__(self) -> UploadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def failed(self) -> bool:
        with self._lock:
            return bool(self._failures)

    def submit(self, what: str, fn: Callable[[], Any]) -> None:
        """Run `fn` (a task named `what`, e.g. its key) on the pool; blocks while it is full.

        Raises ShardStoreError as soon as any earlier task has failed: stop generating.
        """
        if self._closed:
            raise RuntimeError("UploadPool.submit after close()")
        self._raise_if_failed()
        if self._ordered:
            while not self._slots.acquire(blocking=False):
                self._retire_head()
                self._raise_if_failed()
        else:
            self._retire_done()
            self._slots.acquire()
            self._raise_if_failed(release=True)
        index = self._submitted
        self._submitted += 1
        future = self._executor.submit(fn)
        future.add_done_callback(functools.partial(self._done, what))
        self._pending.append((index, what, future))

    def _done(self, what: str, future: Future[Any]) -> None:
        # Runs on the worker thread as soon as a task ends.
        error = None if future.cancelled() else future.exception()
        if error is not None:
            with self._lock:
                self._failures.append((what, error))
        if not self._ordered:
            self._slots.release()

    def _retire(self, index: int, what: str, future: Future[Any]) -> None:
        try:
            if future.cancelled() or future.exception() is not None:
                return  # a failure is recorded by _done
            try:
                result = self._on_result(future.result()) if self._on_result else future.result()
            except Exception as e:
                with self._lock:
                    self._failures.append((what, e))
                return
            self._results[index] = result
        finally:
            if self._ordered:
                self._slots.release()

    def _retire_head(self) -> None:
        index, what, future = self._pending.popleft()
        wait([future])
        self._retire(index, what, future)

    def _retire_done(self) -> None:
        pending, self._pending = self._pending, collections.deque()
        for item in pending:
            if item[2].done():
                self._retire(*item)
            else:
                self._pending.append(item)

    def _raise_if_failed(self, release: bool = False) -> None:
        with self._lock:
            failures = list(self._failures)
        if not failures:
            return
        if release:
            self._slots.release()
        what, error = failures[0]
        raise ShardStoreError(
            f"{len(failures)} image(s) could not be stored; first: {what}: {type(error).__name__}: {error}. "
            "The shard is not committed; it can be retried."
        ) from error

    def drain(self) -> list[ImageResult]:
        """Wait for every task; the results in submission order. Raises ShardStoreError if any
        task failed (its image is not stored)."""
        while self._pending:
            if self.failed:
                for _, _, future in self._pending:
                    future.cancel()  # no point storing more of a shard that will not commit
            self._retire_head()
        self._raise_if_failed()
        results = [self._results[i] for i in sorted(self._results)]
        self._results.clear()
        return results

    def close(self) -> None:
        """Cancel queued tasks and wait for running ones (an upload cannot be interrupted)."""
        if self._closed:
            return
        self._closed = True
        for _, _, future in self._pending:
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
