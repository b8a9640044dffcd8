"""The self-test's stages, most valuable first: correctness on the device, then the speed numbers.

Every stage emits its own JSON lines (runner.Context.emit). Sizes: the real model's widths
(published Qwen-Image configs) unless `--tiny`, which runs the same code at toy widths on the CPU
(the test suite's smoke run). Weights are made on the device in the run's dtype (random, seeded):
nothing multi-GB goes through the disk; the hub-layout loading path is covered by one slice of
`--slice-blocks` blocks written as shards + index and loaded with `load_pipeline`.
"""

from __future__ import annotations

from ditfleet.model.networks.attention_backend import BACKEND_NAMES

# Registered in run order: the checks (checks.py, compile_check.py), then the speed numbers (speed.py).
from ditfleet.workers.selftest import checks, compile_check, speed, vqa  # noqa: F401 - registers them

__all__ = ["BACKEND_NAMES"]
