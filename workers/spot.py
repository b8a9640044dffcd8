"""Spot reclaim: on SIGTERM a worker actor gives its shard up cleanly and exits.

A cloud provider reclaims a spot node with a notice, then SIGTERM to its processes, then SIGKILL.
Ray's own SIGTERM handler in a worker process raises SystemExit wherever the main thread is: the
shard dies half way, the driver sees the actor die and counts a failed attempt. Instead:

- SIGTERM while a shard runs: the handler only asks the worker to stop (`request_stop`); the
  shard loop raises ShardAbandoned at its next image, the shard writer aborts, nothing is
  committed, and the driver requeues the shard without counting an attempt (driver.dispatch);
  once the call has returned, the worker signals itself again and exits (below);
- SIGTERM while idle: Ray's handler runs as before, and the process exits at once.

Ray runs the methods of a sync actor (and its __init__) on the worker process's main thread,
which is the only thread that can install a signal handler and the one Python runs handlers
on, so the handler is installed from __init__ and sees a consistent "busy" flag.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ditfleet.workers.startup_phase import current_actor_id

EXIT_AFTER_S = 0.5  # after the abandoned call returns: time for Ray to send its result


class StopOnSigterm:
    """SIGTERM -> `request_stop()` while a shard runs (`with guard.busy(): ...`), else the
    handler that was there before (Ray's: exit). After a busy block that was asked to stop, the
    process sends itself SIGTERM again, so it exits once idle."""

    def __init__(self, request_stop: Callable[[], None]) -> None:
        self.request_stop = request_stop
        self.stopping = False
        self._busy = False
        self._previous: Any = None
        self.installed = False

    def install(self) -> StopOnSigterm:
        """Install the handler if this is a Ray actor's main thread; a no-op elsewhere (a worker
        used in-process by tests or benchmarks keeps the default behaviour)."""
        if threading.current_thread() is threading.main_thread() and current_actor_id() is not None:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.stopping = True
        self.request_stop()
        if self._busy:
            return  # the shard loop sees the stop request at its next image
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: exit as the default action would
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark a shard as running: a SIGTERM meanwhile asks it to stop instead of exiting."""
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
            if self.stopping and self.installed:
                # Let Ray send this call's result (ShardAbandoned) first, then exit via the handler.
                timer = threading.Timer(EXIT_AFTER_S, os.kill, (os.getpid(), signal.SIGTERM))
                timer.daemon = True
                timer.start()
