"""The driver's metrics, exported through Ray (`ray.util.metrics`): shards queued, in flight and
left, actors by state, and shard outcomes, tagged with the job's name.

`DriverMetrics` is a dispatch events sink (like driver.progress.JobProgress); `run_job` hands
dispatch both, through `FanOut`. Metrics are created at the first event, when Ray is connected
(a run with nothing to do never creates any). Ray exports them with a `ray_` prefix:
`ray_ditfleet_shards{state="queued",job="..."}`, `ray_ditfleet_actors{state="ready",...}`,
`ray_ditfleet_shard_outcomes_total{outcome="committed",...}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ditfleet.driver.dispatch.types import DispatchEvents, DispatchSnapshot, ShardFailure

SHARDS = "ditfleet_shards"
ACTORS = "ditfleet_actors"
SHARD_OUTCOMES = "ditfleet_shard_outcomes"
ACTOR_EVENTS = "ditfleet_actor_events"


class FanOut(DispatchEvents):
    """Passes every dispatch event to each sink in turn; `finish` is left to each sink's owner."""

    def __init__(self, *sinks: DispatchEvents | None) -> None:
        self.sinks = [s for s in sinks if s is not None]


def _to_every_sink(event: str) -> Callable[..., None]:
    def forward(self: FanOut, *args: Any) -> None:
        for sink in self.sinks:
            getattr(sink, event)(*args)

    forward.__name__ = event
    return forward


# Every event DispatchEvents declares, so that a new one reaches every sink without a change here.
for _event in [name for name in vars(DispatchEvents) if not name.startswith("_") and name != "finish"]:
    setattr(FanOut, _event, _to_every_sink(_event))


class DriverMetrics(DispatchEvents):
    """Gauges of the dispatch state (set at every loop turn) and counters of its events."""

    def __init__(self, job: str = "") -> None:
        self.tags = {"job": job or "unnamed"}
        self._made = False

    def _make(self) -> None:
        if self._made:
            return
        from ray.util.metrics import Counter, Gauge

        keys = ("job", "state")
        self._shards = Gauge(
            SHARDS, "Shards of the running job: queued, in_flight, pending (not settled)", keys
        )
        self._actors = Gauge(ACTORS, "Worker actors of the running job: starting, ready", keys)
        self._outcomes = Counter(
            SHARD_OUTCOMES, "Shard runs settled: committed, retried, failed", ("job", "outcome")
        )
        self._actor_events = Counter(
            ACTOR_EVENTS, "Actor events: started, ready, lost, retired", ("job", "event")
        )
        self._made = True

    def _count(self, counter: str, key: str, value: str, n: float = 1) -> None:
        self._make()
        getattr(self, counter).inc(n, {**self.tags, key: value})

    def tick(self, snapshot: DispatchSnapshot) -> None:
        self._make()
        for state, n in (
            ("queued", snapshot.queued),
            ("in_flight", snapshot.in_flight),
            ("pending", snapshot.pending_shards),
        ):
            self._shards.set(n, {**self.tags, "state": state})
        for state, n in (("starting", snapshot.actors_starting), ("ready", snapshot.actors_ready)):
            self._actors.set(n, {**self.tags, "state": state})

    def actor_starting(self, count: int) -> None:
        self._count("_actor_events", "event", "started", count)

    def actor_ready(self, worker_id: str, report: dict, startup_s: float) -> None:
        self._count("_actor_events", "event", "ready")

    def actor_lost(self, worker_id: str, kind: str, error: str, starting: bool) -> None:
        self._count("_actor_events", "event", "start_failed" if starting else "lost")

    def actor_retired(self, worker_id: str) -> None:
        self._count("_actor_events", "event", "retired")

    def shard_committed(self, shard: Any, result: Any) -> None:
        self._count("_outcomes", "outcome", "committed")

    def shard_retry(self, shard: Any, attempt: int, error: str) -> None:
        self._count("_outcomes", "outcome", "retried")

    def shard_failed(self, shard: Any, failure: ShardFailure) -> None:
        self._count("_outcomes", "outcome", "failed")

    def finish(self) -> None:
        """Zero the gauges once the job is over, so a dashboard does not show a stale queue."""
        if self._made:
            self.tick(DispatchSnapshot(0, 0, 0, 0, 0, 0.0))
