"""The node self-test: correctness and speed of the GPU path on one GPU in minutes.

    python3 -m ditfleet.workers.selftest --out /tmp/selftest        # on a GPU node (<= 7 minutes)
    python3 -m ditfleet.workers.selftest --tiny --out /tmp/smoke    # toy widths on the CPU (seconds)

Needs torch (2.11 or newer on a GPU), safetensors, numpy, pillow and pyarrow, which a stock CUDA
PyTorch image has; never Ray, pydantic or boto3. diffusers is used for the side-by-side checks
when it is importable. One JSON line per measurement on stdout as soon as it is measured
(also in OUT/selftest.jsonl), the log in OUT/selftest.log; docs/performance.md says what each
line means. Stages live in `checks.py` and `compile_check.py` (pass/fail first), then `speed.py`,
`vqa.py`, `worker_path.py` and `fp8_speed.py`, registered with `runner.stage` as `stages.py` imports
them; `parts.py` has what they share, `runner.py` and `child_process.py` run them.
"""
