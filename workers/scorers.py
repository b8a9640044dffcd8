"""The image scorers a job runs, built with what their rows (model.quality.table) say they need:
the pipeline's text encoder for a scorer that asks its Qwen2.5-VL (`vqa`), the model its setting
names, made local on this node, for one that needs a model of its own (`clip`).

Used by the actor (quality.scorers, scored where each image is made) and by `ditfleet score`
(an existing output's images).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditfleet.model.quality import ImageScorer, ScorerInputs, scorer
from ditfleet.model.quality.table import MODEL, PIPELINE_QWEN_VL, ScorerRow, needing, scorer_row
from ditfleet.workers.contract import MODEL_CACHE_DIR
from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.fetch import FetchConfig, fetch_model
from ditfleet.workers.weights.node_cache import Layout


def model_layout(row: ScorerRow) -> Layout:
    """What the model folder of a scorer that needs one holds: its row's model as transformers'
    save_pretrained writes it (a hub snapshot has the same files)."""
    return Layout(
        setting=row.setting_key,
        what=row.model or "",
        required=("config.json",),  # the processor files differ across transformers versions
        allow=("*.json", "*.txt", "*.safetensors"),
    )


def fetch_scorer_model(
    name: str, source: str, cache_dir: str, s3: S3Config, config: FetchConfig | None = None
) -> Path:
    """The model of scorer `name` that `source` names (a local folder, s3://bucket/prefix or
    hf://org/name@rev) as a local folder, fetched once per node like the model; ModelFetchError
    naming the setting."""
    return fetch_model(source, cache_dir, s3, config, layout=model_layout(scorer_row(name))).local_path


def build_scorers(
    names: Sequence[str],
    *,
    text_encoder: Any = None,
    models: Mapping[str, str | None] | None = None,
    cache_dir: str = MODEL_CACHE_DIR,
    s3: S3Config | None = None,
    fetch: FetchConfig | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[ImageScorer]:
    """The scorers called `names`, each once, in order. `text_encoder`: the pipeline's loaded one
    (unwrapped from the actor's placement); `models`: the model source of each scorer that needs
    one, by name, as the job gives it (WorkerConfig.scorer_models), fetched into `cache_dir` when
    remote and only for the scorers asked for; `device`: where those run (default the CPU)."""
    local = {
        row.name: fetch_scorer_model(row.name, source, cache_dir, s3 or S3Config(), fetch)
        for row in needing(names, MODEL)
        if (source := (models or {}).get(row.name)) is not None
    }
    inputs = ScorerInputs(
        text_encoder=text_encoder, models=local, device=device or torch.device("cpu"), dtype=dtype
    )
    return [scorer(name, inputs) for name in dict.fromkeys(names)]


@dataclass(frozen=True)
class ScorerSource:
    """A scorer by name and where its model comes from, as plain data: what `ditfleet score`
    hands its threads or Ray tasks, each of which builds the scorer once (`build`)."""

    name: str
    model_path: str | None = (
        None  # a scorer asking the pipeline's Qwen2.5-VL (vqa): the model whose encoder asks
    )
    scorer_model: str | None = None  # a scorer with a model of its own (clip): its row's setting
    cache_dir: str = MODEL_CACHE_DIR
    s3: S3Config | None = None

    def check(self) -> None:
        """ValueError for an unknown name or a model-based scorer without its model, before any
        work (nothing is loaded)."""
        row = scorer_row(self.name)
        if row.needs == PIPELINE_QWEN_VL and self.model_path is None:
            raise ValueError(
                f"the {row.name} scorer needs the Qwen-Image model whose text encoder asks: give --model"
            )
        if row.needs == MODEL and self.scorer_model is None:
            raise ValueError(
                f"the {row.name} scorer needs {row.model}: give --scorer-model (alias --clip-model)"
            )

    def build(self) -> ImageScorer:
        """The scorer, on this process's GPU when it has one (bf16), else on the CPU (fp32)."""
        from ditfleet.model.family import load_text_encoder

        self.check()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        text_encoder = None
        if scorer_row(self.name).needs == PIPELINE_QWEN_VL:
            assert self.model_path is not None
            local = fetch_model(self.model_path, self.cache_dir, self.s3 or S3Config()).local_path
            text_encoder = load_text_encoder(local, device, dtype)
        [built] = build_scorers(
            [self.name],
            text_encoder=text_encoder,
            models={self.name: self.scorer_model},
            cache_dir=self.cache_dir,
            s3=self.s3,
            device=device,
            dtype=dtype,
        )
        return built
