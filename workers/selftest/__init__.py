"""The node self-test: correctness and speed of the GPU path on one GPU in minutes.

    python3 -m ditfleet.workers.selftest --out /tmp/selftest        # on a GPU node (<= 7 minutes)
    python3 -m ditfleet.workers.selftest --tiny --out /tmp/smoke    # toy widths on the CPU (seconds)

Needs torch (2.11 or newer on a GPU), safetensors, numpy, pillow and pyarrow, which a stock CUDA
PyTorch image has; never Ray, pydantic or boto3. diffusers is used for the side-by-side checks
when it is importable. One JSON line per measurement on stdout as soon as it is measured
(also in OUT/selftest.jsonl), the log in OUT/selftest.log; docs/performance.md says what each
line means. The stages register with `runner.stage` when `stages.py` imports their modules.
"""
