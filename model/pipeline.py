"""Text-to-image: prompts -> embeddings -> seeded noise -> denoise with true CFG -> decode."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sampling import Conditioning, TimestepBank, denoise, initial_noise, latent_grid, unpack_latents
from .scheduler import SchedulerConfig
from .text_encoder import TextEncoder
from .transformer import QwenImageTransformer

DEFAULT_NEGATIVE_PROMPT = " "
CFG_MODES = ("serial", "batched", "auto")
# "auto" batches the two CFG passes only while one pass is too small to fill a GPU (tokens per
# pass below this) and concatenating them pads little; larger passes gain nothing from doubling
# the batch and would pay twice the activation memory. CPUs always run serial.
AUTO_BATCHED_MAX_TOKENS = 4096
AUTO_BATCHED_MAX_PADDING = 0.05


def cfg_batched_for(
    mode: str, device_type: str, batch: int, image_tokens: int, cond_len: int, uncond_len: int
) -> bool:
    """Serial or batched CFG for one request. "auto": batched only on CUDA, while one pass has
    fewer than AUTO_BATCHED_MAX_TOKENS tokens and concatenating the branches pads at most
    AUTO_BATCHED_MAX_PADDING of them."""
    if mode not in CFG_MODES:
        raise ValueError(f"cfg_mode must be one of {CFG_MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "batched"
    if device_type != "cuda":
        return False
    longest = max(cond_len, uncond_len)
    padding = abs(cond_len - uncond_len) / (2 * (image_tokens + longest))
    return batch * (image_tokens + longest) < AUTO_BATCHED_MAX_TOKENS and padding <= AUTO_BATCHED_MAX_PADDING


class TextToImagePipeline:
    def __init__(
        self,
        transformer: QwenImageTransformer,
        vae: torch.nn.Module,
        scheduler: SchedulerConfig,
        text_encoder: TextEncoder | None = None,
        model_id: str = "",
        model_revision: str = "",
        cfg_batched: bool = False,
        cfg_mode: str | None = None,
    ) -> None:
        self.transformer = transformer
        self.vae = vae
        self.scheduler = scheduler
        self.text_encoder = text_encoder
        self.model_id, self.model_revision = model_id, model_revision
        mode = cfg_mode if cfg_mode is not None else ("batched" if cfg_batched else "serial")
        if mode not in CFG_MODES:
            raise ValueError(f"cfg_mode must be one of {CFG_MODES}, got {mode!r}")
        self.cfg_mode = mode
        self.timestep_bank = TimestepBank()

    @property
    def cfg_batched(self) -> bool:
        """Whether CFG always runs batched (pads both branches to one text length)."""
        return self.cfg_mode == "batched"

    def batch_cfg(self, batch: int, image_tokens: int, cond_len: int, uncond_len: int) -> bool:
        """Whether this request's two CFG passes run as one forward (see cfg_batched_for)."""
        return cfg_batched_for(self.cfg_mode, self.device.type, batch, image_tokens, cond_len, uncond_len)

    @property
    def device(self) -> torch.device:
        return self.transformer.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.img_in.weight.dtype

    def set_modulation_cache(self, mode: str) -> None:
        self.transformer.modulation_cache.set_mode(mode)
        self.timestep_bank.clear()

    @torch.no_grad()
    def encode_prompt(
        self, prompts: Sequence[str], max_length: int = 512
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D) in the pipeline dtype, mask (B, L) long)."""
        if self.text_encoder is None:
            raise ValueError(
                "this pipeline has no text encoder: pass prompt_embeds / prompt_embeds_mask instead"
            )
        embeds, mask = self.text_encoder.encode(list(prompts), max_length)
        return embeds.to(self.device, self.dtype), mask.to(self.device)

    def count_tokens(self, prompts: Sequence[str], max_length: int = 512) -> list[int] | None:
        """Each prompt's embedding length, from the tokenizer alone; None if the encoder can't say."""
        count = getattr(self.text_encoder, "count_tokens", None)
        return None if count is None else list(count(list(prompts), max_length))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, N, 64) -> images (B, 3, H, W) in [0, 1], fp32."""
        h, w = latent_grid(height, width)
        z = unpack_latents(latents, h, w).to(self.vae_dtype)
        image = self.vae.decode(self.vae.denormalize(z))  # (B, 3, H, W) in [-1, 1]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @property
    def vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @torch.no_grad()
    def generate(
        self,
        prompt: Sequence[str] | None = None,
        negative_prompt: Sequence[str] | str | None = None,
        *,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        height: int,
        width: int,
        steps: int,
        true_cfg_scale: float | Sequence[float] = 4.0,
        seeds: Sequence[int],
        max_sequence_length: int = 512,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1], fp32; B = len(seeds).

        True CFG is on when every `true_cfg_scale > 1` and a negative prompt exists (default " "
        when prompts are given as text). A list of scales lets one batch carry per-row scales.
        """
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of prompt or prompt_embeds")
        if prompt is not None:
            prompt_embeds, prompt_embeds_mask = self.encode_prompt(prompt, max_sequence_length)
        assert prompt_embeds is not None
        B = prompt_embeds.shape[0]
        if len(seeds) != B:
            raise ValueError(f"need one seed per image: {B} prompts but {len(seeds)} seeds")
        scales = torch.as_tensor(
            true_cfg_scale if isinstance(true_cfg_scale, Sequence) else [true_cfg_scale] * B,
            dtype=torch.float32,
        )
        do_cfg = bool((scales > 1).all())
        if do_cfg and negative_prompt_embeds is None:
            if prompt is None and negative_prompt is None:
                do_cfg = False  # embeddings given without negatives: nothing to guide against
            else:
                neg = negative_prompt if negative_prompt is not None else DEFAULT_NEGATIVE_PROMPT
                neg_list = [neg] * B if isinstance(neg, str) else list(neg)
                negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(
                    neg_list, max_sequence_length
                )
        cond = _conditioning(prompt_embeds, prompt_embeds_mask, self.device, self.dtype)
        uncond = None
        if do_cfg:
            assert negative_prompt_embeds is not None
            uncond = _conditioning(
                negative_prompt_embeds, negative_prompt_embeds_mask, self.device, self.dtype
            )
        latents = initial_noise(list(seeds), height, width, self.device, self.dtype)
        scale_arg: torch.Tensor | float = (
            float(scales[0]) if bool((scales == scales[0]).all()) else scales.to(self.device)
        )
        bank = self.timestep_bank if self.transformer.modulation_cache.mode == "table" else None
        latents = denoise(
            self.transformer,
            latents,
            cond,
            uncond,
            scale_arg,
            latent_grid(height, width),
            steps,
            self.scheduler,
            cfg_batched=uncond is not None
            and self.batch_cfg(B, latents.shape[1], cond.embeds.shape[1], uncond.embeds.shape[1]),
            timestep_bank=bank,
            on_step=on_step,
        )
        return self.decode(latents, height, width)


def _conditioning(embeds: torch.Tensor, mask: torch.Tensor | None, device, dtype) -> Conditioning:
    """Embeddings on the device, cut to the longest prompt; the mask dropped when nothing is padded.

    Padding past every prompt's end is work for nothing; a batch whose prompts are all the same
    length needs no mask at all, so attention runs unmasked (flash kernels on CUDA).
    """
    embeds = embeds.to(device, dtype)
    if mask is None:
        return Conditioning(embeds, None)
    if mask.shape != embeds.shape[:2]:
        raise ValueError(
            f"prompt mask {tuple(mask.shape)} does not match embeddings {tuple(embeds.shape[:2])}"
        )
    mask = mask.to(device)
    real = mask.to(torch.bool)
    longest = int(real.sum(dim=1).max()) if real.numel() else 0
    if longest < mask.shape[1] and not bool(real[:, longest:].any()):
        embeds, mask, real = embeds[:, :longest], mask[:, :longest], real[:, :longest]
    return Conditioning(embeds, None if bool(real.all()) else mask)
