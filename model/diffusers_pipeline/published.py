"""The sampling defaults a diffusers checkpoint's publisher gives (steps, guidance, text length),
and, for a checkpoint not in the table, its pipeline class's own `__call__` defaults. Torch-free:
the job spec resolves its defaults from these when it plans (`ditfleet plan` says which came from
where), as model/qwen_image/published/schedules.py does for the native family.

A checkpoint is recognised by its hub id: `hf://org/name@rev`, or a local folder inside a hub
cache (`.../models--org--name/snapshots/<rev>`). Otherwise the pipeline class's `__call__`
defaults apply (read from diffusers' source: index.call_defaults), which for some classes are
not what the checkpoints' cards use (FluxPipeline 28 steps, the FLUX.1-dev card 50): a job names
its steps and guidance then, or `ditfleet plan` shows what it will run.

The table's sources: each model's card (its diffusers example) and model_index.json on the
Hugging Face Hub, read 2026-12-06 (docs/real-model.md lists them with their licences).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditfleet.model.diffusers_pipeline.index import call_defaults, call_parameters

# How a pipeline's `guidance_scale` acts (what `sampling.true_cfg_scale` becomes for it):
DISTILLED = "distilled guidance (an input of the transformer, one pass per step)"
CFG = "classifier-free guidance (two passes per step while > 1)"
OFF = "off (one pass per step)"


@dataclass(frozen=True)
class PublishedDefaults:
    """What a diffusers checkpoint's publisher (or its pipeline class) gives for sampling it."""

    name: str  # the hub id as its publisher names it, or "<class>.__call__"
    class_name: str  # its model_index.json `_class_name`
    steps: int
    true_cfg_scale: float  # the pipeline's guidance_scale
    guidance: str  # DISTILLED, CFG or OFF
    max_sequence_length: int | None  # the text length its example passes (None: the class's default)
    licence: str | None = None  # its card's `license:` (workers/weights/licence.py knows the ids)
    lora_name: None = None  # no LoRA brings these (sampling_defaults reads the attribute)

    @property
    def negative_prompt(self) -> str | None:
        # ditfleet runs guidance only with a negative prompt (model.generation.guidance.cfg_on):
        # "" keeps a guidance scale > 1 in effect (the pipelines treat "" as no negative text);
        # None turns it off.
        return "" if self.guidance != OFF and self.true_cfg_scale > 1 else None

    def text_length(self) -> int | None:
        """The text length to pass: the card's, else the pipeline class's `__call__` default."""
        if self.max_sequence_length is not None:
            return self.max_sequence_length
        found = call_defaults(self.class_name).get("max_sequence_length")
        return found if isinstance(found, int) else None

    def defaults(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "true_cfg_scale": self.true_cfg_scale,
            "negative_prompt": self.negative_prompt,
        }


# The models issue 49 names, with their cards' diffusers examples.
CHECKPOINTS: tuple[PublishedDefaults, ...] = (
    PublishedDefaults("black-forest-labs/FLUX.1-dev", "FluxPipeline", 50, 3.5, DISTILLED, 512, "flux-1-dev-non-commercial-license"),
    PublishedDefaults("black-forest-labs/FLUX.1-schnell", "FluxPipeline", 4, 0.0, OFF, 256, "apache-2.0"),
    PublishedDefaults("black-forest-labs/FLUX.2-klein-4B", "Flux2KleinPipeline", 4, 1.0, OFF, None, "apache-2.0"),
    PublishedDefaults("Tongyi-MAI/Z-Image-Turbo", "ZImagePipeline", 9, 0.0, OFF, None, "apache-2.0"),
    PublishedDefaults("stabilityai/stable-diffusion-3.5-large", "StableDiffusion3Pipeline", 28, 3.5, CFG, None, "stabilityai-ai-community"),
    PublishedDefaults("stabilityai/stable-diffusion-3.5-large-turbo", "StableDiffusion3Pipeline", 4, 0.0, OFF, None, "stabilityai-ai-community"),
    PublishedDefaults("stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline", 40, 4.5, CFG, None, "stabilityai-ai-community"),
    PublishedDefaults("Qwen/Qwen-Image-2.1", "QwenImage21Pipeline", 40, 1.0, OFF, None, "qwen-research"),
)  # fmt: skip

# A folder of a hub cache: <cache>/models--<org>--<name>/snapshots/<revision>[/...]
_HUB_CACHE_PATH = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+")


def hub_id_of(model_path: str) -> str | None:
    """The hub id a model path names: `hf://org/name@rev`, or a hub cache's snapshot folder."""
    if model_path.startswith("hf://"):
        return model_path.removeprefix("hf://").split("@", 1)[0] or None
    found = _HUB_CACHE_PATH.search(Path(model_path.removeprefix("file://")).as_posix())
    return f"{found.group(1)}/{found.group(2)}" if found else None


def by_hub_id(repo_id: str) -> PublishedDefaults | None:
    return next((c for c in CHECKPOINTS if c.name.lower() == repo_id.lower()), None)


def by_pipeline_class(class_name: str, guidance_embeds: bool | None = None) -> PublishedDefaults | None:
    """The class's own `__call__` defaults (its steps and guidance_scale, its text length), None
    when its source spells no step count.

    A `__call__` that also takes `true_cfg_scale` (FLUX.1, Kontext) runs CFG by that one, and its
    `guidance_scale` is distilled guidance, an input of the transformer, which a transformer
    without `guidance_embeds` (its config.json; FLUX.1-schnell) ignores."""
    found = call_defaults(class_name)
    # The pipeline's scale: guidance_scale, else (a pipeline with true CFG only) true_cfg_scale.
    steps, scale = found.get("num_inference_steps"), found.get("guidance_scale", found.get("true_cfg_scale"))
    if not isinstance(steps, int):
        return None
    scale = float(scale) if isinstance(scale, (int, float)) else 1.0
    params = call_parameters(class_name) or ()
    distilled = "true_cfg_scale" in params and "guidance_scale" in params
    if scale <= 1 or (distilled and guidance_embeds is False):
        guidance = OFF
    else:
        guidance = DISTILLED if distilled else CFG
    text = found.get("max_sequence_length")
    return PublishedDefaults(
        f"{class_name}.__call__", class_name, steps, scale, guidance, text if isinstance(text, int) else None
    )


def for_checkpoint(model_path: str, class_name: str | None) -> tuple[PublishedDefaults, str] | None:
    """(the defaults of the checkpoint at `model_path`, how it was recognised): its hub id in the
    table, else (a diffusers pipeline class `class_name`) that class's `__call__` defaults."""
    repo = hub_id_of(model_path)
    if repo is not None and (found := by_hub_id(repo)) is not None:
        return found, f"its hub id {repo}"
    if class_name is None:
        return None
    config = _transformer_config(model_path)
    embeds = config.get("guidance_embeds") if config is not None else None
    own = by_pipeline_class(class_name, embeds if isinstance(embeds, bool) else None)
    return (own, f"diffusers' {class_name}.__call__ defaults") if own is not None else None


def _transformer_config(model_path: str) -> dict | None:
    """A local checkpoint's transformer/config.json (None elsewhere or when unreadable)."""
    path = Path(model_path.removeprefix("file://")) / "transformer" / "config.json"
    try:
        found = json.loads(path.read_text()) if "://" not in model_path.removeprefix("file://") else None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
