"""What the text-to-image pipeline (model.generation.pipeline) asks of a family's modules, as
Protocols: the denoiser (its DiT), the VAE and the text encoder. A family's classes meet them
structurally (model/qwen_image/: QwenImageTransformer, QwenImageVAE, QwenVLTextEncoder, and the
tiny model's encoder), so the pipeline and the sampling loop name no family's class; the family
also hands the pipeline its `prepare_inputs` (model.generation.sampling.PrepareInputs), the DiT's
keyword arguments for one call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from ditfleet.model.family_types import DiTConfig
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH


class ModulationCacheControl(Protocol):
    """The denoiser's modulation cache as the pipeline switches it (model.settings' modulation_cache)."""

    def set_mode(self, mode: str) -> None: ...

    def mode_on(self, device_type: str) -> str: ...  # the mode that runs there ("auto" resolved)


class Denoiser(Protocol):
    """A family's DiT: called with what its family's `prepare_inputs` made (and `step_cache=` when a
    step cache serves the call), it returns the velocity (B, N, C) of the packed latents."""

    # Where and in what dtype it computes: the pipeline's own device and dtype.
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def config(self) -> DiTConfig: ...  # its depth: the blocks a step cache keeps state for

    @property
    def modulation_cache(self) -> ModulationCacheControl: ...

    def fill_modulation_table(self, timesteps: Sequence[torch.Tensor], dtype: torch.dtype) -> int:
        """The 'table' modulation cache filled for a schedule's timestep tensors; entries filled."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class Vae(Protocol):
    """A family's VAE as the pipeline decodes with it: normalised latents (B, C, h, w) ->
    `denormalize` -> `decode` -> images (B, 3, H, W) in [-1, 1]."""

    def decode(self, z: torch.Tensor) -> torch.Tensor: ...

    def denormalize(self, z: torch.Tensor) -> torch.Tensor: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...  # its dtype


class TextEncoder(Protocol):
    # Read-only: an encoder may hold it as an attribute or compute it (a property).
    @property
    def hidden_size(self) -> int: ...

    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # Optional: `count_tokens(prompts, max_length) -> list[int]`, the L of each prompt's
    # embedding without running the model; the worker batches prompts of like length with it.
