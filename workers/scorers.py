"""The image scorers a job runs, built with what they need (model.quality.scorer): the pipeline's
text encoder for `vqa`, the CLIP model made local on this node for `clip`.

Used by the actor (quality.scorers, scored where each image is made) and by `ditfleet score`
(an existing output's images).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditfleet.model.quality import ImageScorer, ScorerInputs, scorer
from ditfleet.model.quality.clip_score import SETTING as CLIP_SETTING
from ditfleet.model.settings import ScorerName
from ditfleet.workers.contract import MODEL_CACHE_DIR
from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.fetch import FetchConfig, fetch_model
from ditfleet.workers.weights.node_cache import Layout

# What a CLIP model folder holds: transformers' CLIPModel and CLIPProcessor as save_pretrained
# writes them (a hub snapshot of openai/clip-vit-large-patch14 has the same files).
CLIP_LAYOUT = Layout(
    setting=CLIP_SETTING,
    what="a transformers CLIPModel and CLIPProcessor",
    required=("config.json",),  # the processor files differ across transformers versions
    allow=("*.json", "*.txt", "*.safetensors"),
)


def fetch_clip_model(source: str, cache_dir: str, s3: S3Config, config: FetchConfig | None = None) -> Path:
    """The CLIP model `source` names (a local folder, s3://bucket/prefix or hf://org/name@rev) as
    a local folder, fetched once per node like the model; ModelFetchError naming the setting."""
    return fetch_model(source, cache_dir, s3, config, layout=CLIP_LAYOUT).local_path


def build_scorers(
    names: Sequence[str],
    *,
    text_encoder: Any = None,
    clip_model: str | None = None,
    cache_dir: str = MODEL_CACHE_DIR,
    s3: S3Config | None = None,
    fetch: FetchConfig | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[ImageScorer]:
    """The scorers called `names`, each once, in order. `text_encoder`: the pipeline's loaded one
    (unwrapped from the actor's placement); `clip_model`: quality.clip_model as the job gives
    it, fetched into `cache_dir` when remote and only when `clip` is asked for; `device`: where
    `clip` runs (default the CPU)."""
    local_clip = None
    if "clip" in names and clip_model is not None:
        local_clip = fetch_clip_model(clip_model, cache_dir, s3 or S3Config(), fetch)
    inputs = ScorerInputs(
        text_encoder=text_encoder, clip_model=local_clip, device=device or torch.device("cpu"), dtype=dtype
    )
    return [scorer(name, inputs) for name in dict.fromkeys(names)]


@dataclass(frozen=True)
class ScorerSource:
    """A scorer by name and where its model comes from, as plain data: what `ditfleet score`
    hands its threads or Ray tasks, each of which builds the scorer once (`build`)."""

    name: str
    model_path: str | None = None  # vqa: the Qwen-Image model whose text encoder asks
    clip_model: str | None = None  # clip: quality.clip_model
    cache_dir: str = MODEL_CACHE_DIR
    s3: S3Config | None = None

    def check(self) -> None:
        """ValueError for an unknown name or a model-based scorer without its model, before any
        work (nothing is loaded)."""
        if self.name not in typing.get_args(ScorerName):
            raise ValueError(
                f"unknown image scorer {self.name!r}: the scorers are {', '.join(typing.get_args(ScorerName))}"
            )
        if self.name == "vqa" and self.model_path is None:
            raise ValueError(
                "the vqa scorer needs the Qwen-Image model whose text encoder asks: give --model"
            )
        if self.name == "clip" and self.clip_model is None:
            raise ValueError("the clip scorer needs a CLIP model: give --clip-model")

    def build(self) -> ImageScorer:
        """The scorer, on this process's GPU when it has one (bf16), else on the CPU (fp32)."""
        from ditfleet.model.family import resolve_model_dir
        from ditfleet.model.qwen_image.loader import load_text_encoder

        self.check()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        text_encoder = None
        if self.name == "vqa":
            assert self.model_path is not None
            local = fetch_model(self.model_path, self.cache_dir, self.s3 or S3Config()).local_path
            text_encoder = load_text_encoder(resolve_model_dir(local), device, dtype)
        [built] = build_scorers(
            [self.name],
            text_encoder=text_encoder,
            clip_model=self.clip_model,
            cache_dir=self.cache_dir,
            s3=self.s3,
            device=device,
            dtype=dtype,
        )
        return built
