"""Builders that the tests and the benchmarks share (like `torch.testing`): random-weight
checkpoints at Qwen-Image's published widths (`real_widths`), tiny random models in the diffusers
layout (`models`), and hand-written outputs with their manifest rows (`outputs`).

Installed with the package so that bench/ and tests/ import the same code; nothing here is used by
a job. `models` needs diffusers (the `test` extra), imported inside the functions that use it.
The published checkpoints' configs are a model fact: `ditfleet.model.qwen_image.published`.
"""
