"""Where each starting actor is: waiting for resources, placed and loading, compiling, or ready.

Two sources, both read without waiting on the actor (whose constructor blocks its methods):
- Ray's actor table in the GCS: an actor whose creation has not been given a worker process yet
  has no pid (it is pending placement). Why it pends is judged from the nodes' resources: if no
  alive node has enough of every resource it asks for in total, it is unplaceable until a node
  that does joins (an autoscaler's, or one added by hand); if none has enough free now, it waits
  for resources; if one has, Ray is starting its worker process there (placing). An actor whose
  own process is starting holds its resources already, so a full cluster can read as "waiting"
  for the second or two that takes; the notice comes only after much longer waits.
- The phase the actor publishes itself (workers.startup_phase): loading weights, compiling and
  warming bucket i of n, ready.

Only the first source may say "no free resources"; a placed actor is never reported as waiting
for them. When Ray's table cannot be read, the phase says "starting" and claims nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ditfleet.workers.startup_phase import COMPILING, LOADING, READY, read_phase

# Phases the driver tells apart, in start-up order.
UNPLACEABLE = "unplaceable"  # Ray: pending, and no alive node has the resources it asks for
WAITING = "waiting for resources"  # Ray: pending placement, and no node has enough free now
PLACING = "placing"  # Ray: pending placement, a node has room: its worker process is starting
STARTING = "starting"  # placed (or Ray's table unreadable); the process has not reported yet
PHASE_LABELS = {LOADING: "loading weights", COMPILING: "compiling", READY: "ready"}


@dataclass(frozen=True)
class ActorPhase:
    """One starting actor as last seen."""

    phase: str  # UNPLACEABLE | WAITING | STARTING | loading | compiling | ready
    detail: str  # e.g. "bucket 2/3 (512x512)", or what an unplaceable actor asks for
    in_phase_s: float  # since the driver first saw this phase

    def describe(self) -> str:
        if self.phase == COMPILING and self.detail:
            return f"compiling {self.detail.split(', ', 1)[0]}"
        return PHASE_LABELS.get(self.phase, self.phase)

    @property
    def note(self) -> str:
        """What a compiling bucket is expected to take ("about 50 s (first run only)"), or ""."""
        if self.phase != COMPILING or ", " not in self.detail:
            return ""
        return self.detail.split(", ", 1)[1]


def compiling_detail(published: dict) -> str:
    """ "bucket 1/3 (160x96), about 50 s (first run only)" from what the actor published: how long
    the bucket takes depends on whether this machine compiled it before."""
    i, n, name = published.get("bucket"), published.get("buckets"), published.get("name")
    text = f"bucket {i}/{n}" + (f" ({name})" if name else "")
    first, estimate = published.get("first"), published.get("estimate_s")
    if first is True and isinstance(estimate, (int, float)):
        return f"{text}, about {estimate:.0f} s (first run only)"
    if first is False:
        return f"{text}, from this machine's compile cache"
    return text


def actor_id(handle: Any) -> str:
    return handle._actor_id.hex()


def ray_placement(handle: Any) -> bool | None:
    """True: Ray gave the actor a worker process; False: pending placement; None: unknown."""
    try:
        from ray._private import state

        info = state.actors(actor_id(handle))
    except Exception:  # noqa: BLE001 - private table layout changed or GCS busy: say nothing
        return None
    if not isinstance(info, dict) or "State" not in info:
        return None
    if info.get("State") == "ALIVE":
        return True
    return bool(info.get("Pid")) or bool((info.get("Address") or {}).get("Port"))


def fits_some_node(request: dict[str, float], free: bool = False) -> bool | None:
    """Whether any alive node's total (or, with `free`, available) resources cover `request`
    (None: unknown)."""
    try:
        from ray._private import state

        per_node = state.available_resources_per_node() if free else state.total_resources_per_node()
    except Exception:  # noqa: BLE001 - cannot judge; the caller claims nothing
        return None
    wanted = {k: v for k, v in request.items() if v > 0}
    return any(all(res.get(k, 0) >= v for k, v in wanted.items()) for res in per_node.values())


def describe_request(request: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in request.items() if v > 0) or "no resources"


class PhaseTracker:
    """Polls starting actors at most every `every_s` (each poll is one GCS read per actor)."""

    def __init__(self, request: dict[str, float], every_s: float = 1.0) -> None:
        self.request = dict(request)
        self.every_s = every_s
        self._seen: dict[int, tuple[str, str, float]] = {}  # slot -> (phase, detail, first seen)
        self._last_poll = -float("inf")
        self._phases: tuple[ActorPhase, ...] = ()
        self._fits: bool | None = None

    def poll(self, slots: list[Any], now: float | None = None) -> tuple[ActorPhase, ...]:
        """slots: the pool's STARTING slots (their id and handle)."""
        now = time.monotonic() if now is None else now
        # Two GCS reads per starting actor: a fleet of hundreds is polled less often.
        if now - self._last_poll < max(self.every_s, len(slots) / 50):
            return self._phases
        self._last_poll = now
        live = {s.id for s in slots}
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        out = []
        for slot in slots:
            phase, detail = self._phase_of(slot.handle)
            seen = self._seen.get(slot.id)
            if seen is None or seen[:2] != (phase, detail):
                seen = (phase, detail, now)
                self._seen[slot.id] = seen
            out.append(ActorPhase(phase, detail, now - seen[2]))
        self._phases = tuple(out)
        return self._phases

    def _phase_of(self, handle: Any) -> tuple[str, str]:
        published = read_phase(actor_id(handle))
        if published is not None:
            phase = published["phase"]
            return phase, compiling_detail(published) if phase == COMPILING else ""
        if ray_placement(handle) is not False:
            return STARTING, ""
        if self._fits is None:  # node totals change rarely; judged once per tracker
            self._fits = fits_some_node(self.request)
        if self._fits is False:
            return UNPLACEABLE, f"asks for {describe_request(self.request)}; no node has that much"
        free = fits_some_node(self.request, free=True)
        if free is None:
            return STARTING, ""
        return (PLACING, "") if free else (WAITING, "")
