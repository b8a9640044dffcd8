"""The Qwen-Image family: its DiT (transformer, attention, rotary embedding, modulation cache), its
VAE, its Qwen2.5-VL text encoder, its LoRA key map, its memory formula and the published
checkpoints' configs (published/). The bundled tiny model (model/tiny/) is a configuration of it.

Empty on purpose: importing a torch-free module of the family (the config readers, the memory
formula) must not import torch."""
