"""Testing knobs read from the environment, in this one place.

DITFLEET_LEASE_TTL_S: the output lease's length in seconds for `ditfleet run` and
`ditfleet verify --clean` (driver.output.lease; default 120). A testing knob: the integration
tests shorten it to take an output over from a paused driver within seconds. Production runs
leave it unset; see docs/reliability.md for what the lease length does and does not affect.
"""

from __future__ import annotations

import os

from ditfleet.driver.output.lease import LEASE_TTL_S

LEASE_TTL_ENV = "DITFLEET_LEASE_TTL_S"


def lease_ttl_s() -> float:
    """The lease length: DITFLEET_LEASE_TTL_S when set (a number > 0), else the default."""
    text = os.environ.get(LEASE_TTL_ENV, "").strip()
    if not text:
        return LEASE_TTL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{LEASE_TTL_ENV}={text!r}: the lease length must be a number of seconds > 0")
    return value
