"""CLIP score (Hessel et al., "CLIPScore", 2021, without its 2.5 weight): 100 x the cosine of a
CLIP model's image and text embeddings, clipped at 0, the form torchmetrics' `CLIPScore` and most
dataset filters use. Range [0, 100]; typical matched pairs score 25-35 on ViT-L/14.

The model is any transformers `CLIPModel` folder (config, weights, tokenizer and preprocessor
files: what `save_pretrained` or a hub snapshot of e.g. openai/clip-vit-large-patch14 holds). The
caller makes a remote one local first (workers.weights). Text longer than the model's positions
(77 tokens) is truncated, as CLIP was trained. Each image is scored alone, so the score does not
depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .luma import score_each
from .table import scorer_row


class CLIPScore:
    """max(100 * cos(image, text), 0) per image, from a transformers CLIPModel."""

    name = "clip"
    higher_is_better = scorer_row(name).higher_is_better

    def __init__(self, model: Any, processor: Any) -> None:
        self.model, self.processor = model, processor

    @classmethod
    def load(cls, folder: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> CLIPScore:
        """The model and processor saved in `folder`; ValueError naming the setting and folder."""
        try:
            from transformers import CLIPModel, CLIPProcessor
        except ImportError as e:  # an optional extra, like the Qwen2.5-VL encoder's
            raise ImportError("the clip scorer needs `transformers`: pip install 'ditfleet[qwen]'") from e
        if not (Path(folder) / "config.json").is_file():
            raise ValueError(
                f"{scorer_row(cls.name).setting_key}: {folder} holds no config.json; give a folder with a transformers CLIPModel "
                "(config.json, weights, tokenizer and preprocessor files), an s3:// prefix holding one, "
                "or hf://org/name[@revision]"
            )
        try:
            model: Any = CLIPModel.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
            processor = CLIPProcessor.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{scorer_row(cls.name).setting_key}: cannot load a CLIP model and processor from {folder}: {e}. Give a folder "
                "saved by CLIPModel and CLIPProcessor save_pretrained (or a hub snapshot of one)"
            ) from e
        return cls(model.to(device).eval(), processor)

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        return score_each(self.name, pixels, prompts, self._one)

    @torch.no_grad()
    def _one(self, image: torch.Tensor, prompt: str) -> float:
        weight = next(self.model.parameters())
        # The processor resizes and crops on the CPU (transformers' own code: what the model was
        # published with); (3, H, W) uint8 channels first.
        inputs = self.processor(
            text=[prompt],
            images=[image.cpu()],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.model.config.text_config.max_position_embeddings,
        )
        image_embeds = self.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(weight.device, weight.dtype)
        )
        text_embeds = self.model.get_text_features(
            input_ids=inputs["input_ids"].to(weight.device),
            attention_mask=inputs["attention_mask"].to(weight.device),
        )
        cos = torch.nn.functional.cosine_similarity(
            _features(image_embeds).float(), _features(text_embeds).float()
        )
        return max(100.0 * float(cos[0]), 0.0)


def _features(out: Any) -> torch.Tensor:
    """The projected embedding (B, D): transformers 4.x returns the tensor, 5.x an output object
    whose pooler_output holds it."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output
