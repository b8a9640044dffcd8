"""The networks: the DiT (transformer, attention, rotary embedding, modulation cache), the VAE, the text encoder.

Empty on purpose: importing a torch-free module of the group must not import torch."""
