"""What the text-to-image pipeline (model.generation.pipeline) asks of a family's modules, as
Protocols: the denoiser (its DiT), the VAE and the text encoder. A family's classes meet them
structurally (model/qwen_image/: QwenImageTransformer, QwenImageVAE, QwenVLTextEncoder, and the
tiny model's encoder), so the pipeline and the sampling loop name no family's class; the family
also hands the pipeline its `prepare_inputs` (model.generation.sampling.PrepareInputs), the DiT's
keyword arguments for one call, and for an edit model its `EditConditioning` (the Qwen-Image
family's: model.qwen_image.edit_sources.QwenImageEdit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ditfleet.model.family_types import DiTConfig
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH

if TYPE_CHECKING:
    from PIL.Image import Image

# An edit model's source images: one list per prompt, decoded RGB PIL images in the row's order.
SourceImages = Sequence[Sequence["Image"]]


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


@runtime_checkable
class SourceVae(Vae, Protocol):
    """An edit model's VAE, which also encodes its sources: images (B, 3, H, W) in [-1, 1] ->
    `encode` (the posterior's mean) -> `normalize` -> normalised latents (B, C, h, w). A
    text-to-image model's VAE may be loaded without its encoder."""

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def normalize(self, z: torch.Tensor) -> torch.Tensor: ...


class EditConditioning(Protocol):
    """How an edit model conditions on its source images, handed to the pipeline by its family's
    loader as it hands `prepare_inputs`. The pipeline checks each row's sources (`check_sources`),
    has the family encode them on the pipeline's VAE (`encode_sources`; the pipeline packs the
    latents), runs the DiT on `with_sources`' inputs, and warms up on `blank_source`. Where the
    family's text encoder sees images, it has `encode_edit(prompts, sources, conditioning)`, and
    the pipeline hands it this object; else the instructions are encoded as text alone."""

    def check_sources(self, count: int, where: str = "") -> None:
        """Raises ValueError, naming `where`, when a row's `count` sources are not a number the
        model takes."""
        ...

    def vae_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) a width x height source is encoded at (what a batch's rows must share)."""
        ...

    def blank_source(self, width: int, height: int) -> Image:
        """A source of width x height whose size (not its content) decides a warm-up's shapes."""
        ...

    def encode_sources(
        self, vae: SourceVae, sources: SourceImages, device: torch.device
    ) -> tuple[list[torch.Tensor], tuple[tuple[int, int], ...]]:
        """(each source position's normalised latents (B, C, 2h, 2w) for all rows, each source's
        (h, w) grid in packed tokens), the rows sharing their sources' number and sizes."""
        ...

    def with_sources(
        self, source_latents: torch.Tensor, source_grids: tuple[tuple[int, int], ...]
    ) -> Callable[..., dict[str, Any]]:
        """The family's `prepare_inputs` with one batch's packed source latents (B, S, C) and grids
        bound: what the denoise loop calls (a model.generation.sampling.PrepareInputs, which
        imports this module)."""
        ...


class TextEncoder(Protocol):
    # Read-only: an encoder may hold it as an attribute or compute it (a property).
    @property
    def hidden_size(self) -> int: ...

    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # Optional: `count_tokens(prompts, max_length) -> list[int]`, the L of each prompt's
    # embedding without running the model; the worker batches prompts of like length with it.
