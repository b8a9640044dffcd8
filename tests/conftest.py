"""Shared pytest set-up. Fixtures live in their own modules, registered here."""

import os

# Tests run on 2 CPU cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")

pytest_plugins = [
    "tests.fixtures_s3",
    "tests.fixtures_ray",
]
