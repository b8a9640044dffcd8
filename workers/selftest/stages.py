"""The self-test's stages, most valuable first: correctness on the device, then the speed numbers.

Every stage emits its own JSON lines (runner.Context.emit). Sizes: the real model's widths
(published Qwen-Image configs) unless `--tiny`, which runs the same code at toy widths on the CPU
(the test suite's smoke run). Weights are made on the device in the run's dtype (random, seeded):
nothing multi-GB goes through the disk; the hub-layout loading path is covered by one slice of
`--slice-blocks` blocks written as shards + index and loaded with `load_pipeline`.
"""

from __future__ import annotations

# Importing registers the stages. The run order follows from the modules' own imports, not from
# this line's: a module registers after those it imports, and a stage that slots in after another
# (`after=`) imports the module that registers that one.
from ditfleet.workers.selftest import checks, compile_check, fp8_speed, speed, vqa, worker_path  # noqa: F401
