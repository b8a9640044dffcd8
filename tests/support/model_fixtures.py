"""The reference side of the model tests: diffusers' own pipeline over the same weights, and stand-in
prompt embeddings, the tiny model's files under a folder with a model card. The random model folders themselves are built by `ditfleet.testing.models`
(bench/ uses them too)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ditfleet.model.loading.folder import TINY_MODEL_DIR


def text_mask(lens: list[int]) -> torch.Tensor:
    """The attention mask of a batch of prompts `lens` tokens long, right-padded to the longest."""
    mask = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    return mask


def padded_embeds(seed: int, lens: list[int], dim: int = 16, scale: float = 1.0):
    """Stand-in prompt embeddings (random, zero where padded) and their mask."""
    g = torch.Generator().manual_seed(seed)
    mask = text_mask(lens)
    return torch.randn(len(lens), mask.shape[1], dim, generator=g) * scale * mask[..., None], mask


def guided_inputs(
    pos_lens: list[int], neg_lens: list[int], height: int, width: int, dim: int = 16, scale: float = 1.0
) -> dict:
    """Keyword arguments of a true-CFG generation (scale 4) that our `generate` and, through
    `diffusers_images`, the reference take: padded prompt embeddings (seed 0) and negative ones
    (seed 1), and the image size."""
    pos, pos_mask = padded_embeds(0, pos_lens, dim, scale)
    neg, neg_mask = padded_embeds(1, neg_lens, dim, scale)
    return dict(
        prompt_embeds=pos,
        prompt_embeds_mask=pos_mask,
        negative_prompt_embeds=neg,
        negative_prompt_embeds_mask=neg_mask,
        height=height,
        width=width,
        true_cfg_scale=4.0,
    )


def diffusers_transformer(root: Path, dtype: torch.dtype = torch.float32):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype).eval()


def diffusers_pipeline(root: Path, dtype: torch.dtype = torch.float32):
    """The reference QwenImagePipeline over the same weights, without a text encoder."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype).eval(),
        text_encoder=None,
        tokenizer=None,
        transformer=diffusers_transformer(root, dtype),
    )


def diffusers_images(ref, *, steps: int, seeds: list[int], output_type: str = "pt", **inputs) -> torch.Tensor:
    """What the reference pipeline makes from the keyword arguments our `generate` takes (the
    embeddings, size and guidance in `inputs`), one generator per image as ours seeds them."""
    return ref(
        **inputs,
        num_inference_steps=steps,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type=output_type,
    ).images


def tiny_model_copy(tmp_path: Path, card: str | None = None, scheduler: str | None = None) -> Path:
    """The bundled tiny model's files under a folder of our own (tmp_path/model), with `card` as its
    README.md and `scheduler` (a scheduler_config.json) as its scheduler's config where given."""
    return model_copy(TINY_MODEL_DIR, tmp_path / "model", card, scheduler)


def model_copy(base: Path, root: Path, card: str | None = None, scheduler: str | None = None) -> Path:
    """`base`'s files linked under `root`, with `card` as its README.md and `scheduler` (a
    scheduler_config.json, e.g. a published few-step one) as its scheduler's config where given."""
    root.mkdir()
    for entry in base.iterdir():
        if entry.name != "scheduler" or scheduler is None:
            (root / entry.name).symlink_to(entry)
    if card is not None:
        (root / "README.md").write_text(card)
    if scheduler is not None:
        (root / "scheduler").mkdir()
        shutil.copy(scheduler, root / "scheduler" / "scheduler_config.json")
    return root


def job_with_model(tmp_path: Path, model: Path | str, model_lines: str = "", rest: str = "") -> Path:
    """tmp_path/job.yaml: three prompts in tmp_path/p.parquet, output tmp_path/out, `model` as
    model.path with `model_lines` (indented keys) under it, then `rest` (more sections)."""
    pq.write_table(pa.table({"prompt": ["a small red circle"] * 3}), tmp_path / "p.parquet")
    path = tmp_path / "job.yaml"
    path.write_text(
        f"name: job\ninput: {{path: {tmp_path / 'p.parquet'}}}\noutput: {{uri: '{tmp_path / 'out'}'}}\n"
        f"model:\n  path: {model}\n{model_lines}{rest}"
    )
    return path
