"""From files to modules: model folders, checkpoints, weights, LoRA adapters, quantization (FP8).

Empty on purpose: the torch-free modules (folder, lora_spec) must import without torch."""
