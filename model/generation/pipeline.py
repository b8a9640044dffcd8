"""Text-to-image: prompts -> embeddings -> seeded noise -> denoise with true CFG -> decode."""

from __future__ import annotations

import copy
import dataclasses
import logging
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ditfleet.model.generation.attention_backend import attention_backend
from ditfleet.model.generation.guidance import cfg_on, negative_texts
from ditfleet.model.generation.sampling import (
    Conditioning,
    PrepareInputs,
    TimestepBank,
    denoise,
    initial_noise,
    latent_grid,
    pack_latents,
    unpack_latents,
)
from ditfleet.model.generation.scheduler import SchedulerConfig, sigma_schedule
from ditfleet.model.generation.step_cache import StepCache
from ditfleet.model.qwen_image.edit import EditStyle
from ditfleet.model.qwen_image.edit_sources import encode_sources
from ditfleet.model.qwen_image.text_encoder import TextEncoder
from ditfleet.model.qwen_image.transformer import EditInputs, QwenImageTransformer, prepare_inputs
from ditfleet.model.qwen_image.vae import QwenImageVAE
from ditfleet.model.settings import DEFAULT_PIPELINE, MAX_SEQUENCE_LENGTH, CfgMode, PipelineSettings
from ditfleet.model.step_cache_config import StepCacheConfig
from ditfleet.model.tiny.known_words import known_of, unknown_words, unknown_words_warning
from ditfleet.model.tiny.text_encoder import WordTokenizer

if typing.TYPE_CHECKING:
    from ditfleet.model.qwen_image.edit_sources import Image

_log = logging.getLogger(__name__)

# The keyword arguments of `generate` that carry text: prompt_embeds, prompt_embeds_mask,
# negative_prompt_embeds, negative_prompt_embeds_mask (the last two None without CFG); for an
# edit model also its sources: source_latents (B, S, 64) packed and source_grids (n, 2) long on
# the CPU, each source's (h, w) token grid (`encode_guidance(..., sources=...)`).
GuidanceInputs = dict[str, torch.Tensor | None]
# An edit model's source images: one list per prompt, decoded RGB PIL images in the row's order.
SourceImages = Sequence[Sequence["Image"]]
CFG_MODES = typing.get_args(CfgMode)
# "auto" batches the two CFG passes only while one pass is too small to fill a GPU (tokens per
# pass below this) and concatenating them pads little; larger passes gain nothing from doubling
# the batch and would pay twice the activation memory. CPUs always run serial.
AUTO_BATCHED_MAX_TOKENS = 4096
AUTO_BATCHED_MAX_PADDING = 0.05


@dataclass(frozen=True)
class Sampling:
    """How one batch is drawn, beyond its text: image size, schedule length, true-CFG scale (one,
    or one per image) and one seed per image."""

    height: int
    width: int
    steps: int
    seeds: Sequence[int]
    true_cfg_scale: float | Sequence[float] = 4.0


@dataclass
class Generation:
    """What `TextToImagePipeline.run` returns: the images (or packed latents), and the step
    cache that served the batch (None when off): `describe()` and per image `per_image()`."""

    images: torch.Tensor
    step_cache: StepCache | None = None


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
        vae: QwenImageVAE,
        scheduler: SchedulerConfig,
        text_encoder: TextEncoder | None = None,
        model_id: str = "",
        model_revision: str = "",
        settings: PipelineSettings = DEFAULT_PIPELINE,
        edit: EditStyle | None = None,
    ) -> None:
        self.transformer = transformer
        # An edit model's conditioning on its sources (model.qwen_image.edit); None: text-to-image.
        self.edit = edit
        self.vae = vae
        self.scheduler = scheduler
        self.text_encoder = text_encoder
        self.model_id, self.model_revision = model_id, model_revision
        self.settings = settings  # checked when built (PipelineSettings.__post_init__)
        self.cfg_mode = settings.cfg_mode
        self.timestep_bank = TimestepBank()

    def batch_cfg(self, batch: int, image_tokens: int, cond_len: int, uncond_len: int) -> bool:
        """Whether this request's two CFG passes run as one forward (see cfg_batched_for)."""
        return cfg_batched_for(self.cfg_mode, self.device.type, batch, image_tokens, cond_len, uncond_len)

    @property
    def device(self) -> torch.device:
        return self.transformer.img_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.img_in.weight.dtype

    def with_step_cache(self, config: StepCacheConfig | None) -> TextToImagePipeline:
        """This pipeline (the same modules) with another step cache: what calibration compares."""
        other = copy.copy(self)
        other.settings = dataclasses.replace(self.settings, step_cache=config)
        return other

    def prefill_modulation(self, height: int, width: int, steps: int) -> int:
        """Under the 'table' modulation cache, build the whole schedule's modulation of one
        resolution bucket now (the actor's warm-up), with the very timestep tensors `denoise`
        will pass, so that no request, with CFG or without, computes any. Returns the block
        entries filled (0 in another mode)."""
        h, w = latent_grid(height, width)
        sigmas = sigma_schedule(self.scheduler, steps, h * w).to(self.device)
        timesteps = self.timestep_bank.get(sigmas, (steps, h * w, self.scheduler), self.device, self.dtype)
        return self.transformer.fill_modulation_table(timesteps, self.dtype)

    def set_modulation_cache(self, mode: str) -> None:
        self.transformer.modulation_cache.set_mode(mode)
        self.timestep_bank.clear()

    @torch.no_grad()
    def encode_prompt(
        self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D) in the pipeline dtype, mask (B, L) long)."""
        if self.text_encoder is None:
            raise ValueError(
                "this pipeline has no text encoder: pass prompt_embeds / prompt_embeds_mask instead"
            )
        embeds, mask = self.text_encoder.encode(list(prompts), max_length)
        return embeds.to(self.device, self.dtype), mask.to(self.device)

    def unknown_words(self, prompts: Sequence[str]) -> list[str]:
        """Words of `prompts` a word-level (tiny) text encoder does not know; [] for any other."""
        tokenizer = getattr(self.text_encoder, "tokenizer", None)
        if not isinstance(tokenizer, WordTokenizer):
            return []
        return unknown_words(prompts, known_of(tokenizer.vocab))

    def count_tokens(self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH) -> list[int] | None:
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
    def encode_guidance(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str | None] | str | None = None,
        true_cfg_scale: float | Sequence[float] = 4.0,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        sources: SourceImages | None = None,
    ) -> GuidanceInputs:
        """Encode prompts, and their negatives when CFG is on (model.generation.guidance), for `generate`.

        Each branch is padded only to its own longest prompt (what the encoder returns), since the
        DiT takes any text length. A negative shared by the whole batch (the usual " ") is encoded
        once and expanded, so the unconditional pass is never padded. Requests and warm-up both
        build their inputs here, so warm-up traces exactly what requests run.

        sources: an edit model's source images, one list per prompt (`encode_sources`); the rows of
        one call share their sources' number and sizes.
        """
        if (sources is None) != (self.edit is None):
            need = "needs source images (sources=...)" if sources is None else "takes no source images"
            kind = "an edit model" if self.edit is not None else "a text-to-image model"
            raise ValueError(f"{self.model_id or 'this model'}: {kind} {need}")
        if sources is not None:
            return self.encode_sources(
                prompts, sources, negative_prompts, true_cfg_scale, max_sequence_length
            )
        embeds, mask = self.encode_prompt(list(prompts), max_sequence_length)  # (B, L, D), (B, L)
        out: GuidanceInputs = {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": None,
            "negative_prompt_embeds_mask": None,
        }
        if cfg_on(true_cfg_scale):
            neg_list = negative_texts(len(prompts), negative_prompts)
            if len(set(neg_list)) == 1:
                one, one_mask = self.encode_prompt(neg_list[:1], max_sequence_length)  # (1, L', D), (1, L')
                neg_embeds = one.expand(len(prompts), -1, -1)
                neg_mask = one_mask.expand(len(prompts), -1)
            else:
                neg_embeds, neg_mask = self.encode_prompt(neg_list, max_sequence_length)
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = neg_embeds, neg_mask
        return out

    @torch.no_grad()
    def encode_sources(
        self,
        prompts: Sequence[str],
        sources: SourceImages,
        negative_prompts: Sequence[str | None] | str | None,
        true_cfg_scale: float | Sequence[float],
        max_sequence_length: int,
    ) -> GuidanceInputs:
        """`encode_guidance` of an edit model: the instructions as a Qwen2.5-VL that sees the
        sources encodes them (both CFG branches with the row's images, as diffusers does), or as
        text alone where the encoder cannot see images (the tiny one), and the sources' packed
        latents and grids for `run`."""
        assert self.edit is not None
        if len(sources) != len(prompts):
            raise ValueError(
                f"need one list of sources per prompt: {len(prompts)} prompts, {len(sources)} lists"
            )
        for i, row in enumerate(sources):
            self.edit.check_sources(len(row), f"sources[{i}]")
        latents, grids = encode_sources(self.vae, sources, self.edit, self.device)
        out: GuidanceInputs = {
            "source_latents": torch.cat([pack_latents(z) for z in latents], dim=1).to(self.dtype),
            "source_grids": torch.tensor(grids, dtype=torch.long).view(-1, 2),
            "negative_prompt_embeds": None,
            "negative_prompt_embeds_mask": None,
        }
        out["prompt_embeds"], out["prompt_embeds_mask"] = self._encode_edit(
            prompts, sources, max_sequence_length
        )
        if cfg_on(true_cfg_scale):
            negatives = negative_texts(len(prompts), negative_prompts)
            neg = self._encode_edit(negatives, sources, max_sequence_length)
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = neg
        return out

    def _encode_edit(
        self, prompts: Sequence[str], sources: SourceImages, max_length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        encode_edit = getattr(self.text_encoder, "encode_edit", None)
        if encode_edit is None:  # an encoder that cannot see images: the sources are latents only
            return self.encode_prompt(list(prompts), max_length)
        embeds, mask = encode_edit(list(prompts), sources, self.edit, max_length)
        return embeds.to(self.device, self.dtype), mask.to(self.device)

    @torch.no_grad()
    def generate(
        self,
        prompt: Sequence[str] | None = None,
        negative_prompt: Sequence[str | None] | str | None = None,
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
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        decode: bool = True,
        sources: SourceImages | None = None,
        source_latents: torch.Tensor | None = None,
        source_grids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1], fp32; B = len(seeds). With `decode=False`, the packed
        latents (B, N, 64) in the pipeline dtype instead, before the VAE (what the tiny model's
        decoder adaptation trains on). `run` with the same inputs, its images only.

        Text (prompt, negative_prompt) is encoded by `encode_guidance`; embeddings are taken as
        given. True CFG follows model.guidance: on when every `true_cfg_scale > 1` and there is a
        negative (for text, the default " " when none is given; for embeddings, negative
        embeddings). A list of scales lets one batch carry per-row scales.

        An edit model takes its source images with the text (`sources`), or their latents and
        grids with embeddings (`encode_guidance`'s source_latents, source_grids).
        """
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of prompt or prompt_embeds")
        text_neg_with_embeds = negative_prompt is not None and prompt is None
        if text_neg_with_embeds or (negative_prompt_embeds is not None and prompt is not None):
            raise ValueError(
                "pass negative_prompt (text) with prompt, negative_prompt_embeds with prompt_embeds"
            )
        if prompt is not None and (unknown := self.unknown_words(prompt)):
            known = known_of(self.text_encoder.tokenizer.vocab)  # type: ignore[union-attr]
            with_unknown = sum(1 for p in prompt if unknown_words([p], known))
            _log.warning(unknown_words_warning(unknown, with_unknown, len(prompt)))
        inputs: GuidanceInputs = (
            self.encode_guidance(prompt, negative_prompt, true_cfg_scale, max_sequence_length, sources)
            if prompt is not None
            else {
                "prompt_embeds": prompt_embeds,
                "prompt_embeds_mask": prompt_embeds_mask,
                "negative_prompt_embeds": negative_prompt_embeds,
                "negative_prompt_embeds_mask": negative_prompt_embeds_mask,
                "source_latents": source_latents,
                "source_grids": source_grids,
            }
        )
        return self.run(inputs, Sampling(height, width, steps, seeds, true_cfg_scale), decode).images

    @torch.no_grad()
    def run(self, inputs: GuidanceInputs, sampling: Sampling, decode: bool = True) -> Generation:
        """Embedded text (`encode_guidance`'s form) -> a `Generation`: the images (or latents with
        `decode=False`) and the step cache of the pipeline's settings that served them."""
        s = sampling
        cond, uncond = self._conditionings(inputs, s.true_cfg_scale)
        B = cond.embeds.shape[0]
        if len(s.seeds) != B:
            raise ValueError(f"need one seed per image: {B} prompts but {len(s.seeds)} seeds")
        latents = initial_noise(list(s.seeds), s.height, s.width, self.device, self.dtype)
        prepare, source_tokens = self._prepare(inputs, B)
        config = self.settings.step_cache
        cache = None if config is None else StepCache(config, self.transformer.config.num_layers)
        with attention_backend(self.settings.attention_backend, self.device.type):
            latents = denoise(
                self.transformer,
                prepare,
                latents,
                cond,
                uncond,
                _guidance_scale(s.true_cfg_scale, B, self.device),
                latent_grid(s.height, s.width),
                s.steps,
                self.scheduler,
                cfg_batched=uncond is not None
                and self.batch_cfg(
                    B, latents.shape[1] + source_tokens, cond.embeds.shape[1], uncond.embeds.shape[1]
                ),
                timestep_bank=self.timestep_bank
                if self.transformer.modulation_cache.mode_on(self.device.type) == "table"
                else None,
                step_cache=cache,
            )
            images = self.decode(latents, s.height, s.width) if decode else latents
        return Generation(images, cache)

    def _prepare(self, inputs: GuidanceInputs, batch: int) -> tuple[PrepareInputs, int]:
        """The DiT's inputs per call (`prepare_inputs`, or an edit model's with its source tokens)
        and the source tokens per image."""
        sources, grids = inputs.get("source_latents"), inputs.get("source_grids")
        if (sources is None) != (self.edit is None) or (sources is None) != (grids is None):
            raise ValueError(
                "an edit model runs with source_latents and source_grids (encode_guidance(..., "
                "sources=...)); a text-to-image model with neither"
            )
        if sources is None or grids is None:
            return prepare_inputs, 0
        if sources.shape[0] != batch:
            raise ValueError(f"source_latents has {sources.shape[0]} rows for {batch} prompts")
        hw = tuple((int(h), int(w)) for h, w in grids.tolist())
        return EditInputs(sources.to(self.device, self.dtype), hw), sources.shape[1]

    def _conditionings(
        self, inputs: GuidanceInputs, true_cfg_scale: float | Sequence[float]
    ) -> tuple[Conditioning, Conditioning | None]:
        """(conditional, unconditional or None when CFG is off) on the pipeline's device."""
        embeds, negative = inputs["prompt_embeds"], inputs["negative_prompt_embeds"]
        assert embeds is not None
        cond = _conditioning(embeds, inputs["prompt_embeds_mask"], self.device, self.dtype)
        if negative is None or not cfg_on(true_cfg_scale):
            return cond, None
        return cond, _conditioning(negative, inputs["negative_prompt_embeds_mask"], self.device, self.dtype)


def _guidance_scale(true_cfg_scale: float | Sequence[float], batch: int, device) -> torch.Tensor | float:
    """One float when the batch shares its scale, else a (B,) fp32 tensor on the device."""
    scales = torch.as_tensor(
        true_cfg_scale if isinstance(true_cfg_scale, Sequence) else [true_cfg_scale] * batch,
        dtype=torch.float32,
    )
    return float(scales[0]) if bool((scales == scales[0]).all()) else scales.to(device)


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
