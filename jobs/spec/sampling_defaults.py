"""A job's sampling defaults, each with where it came from: the job, the checkpoint's publisher
(model/qwen_image/published/schedules.py: nvidia/Qwen-Image-Flash, the Qwen-Image-Lightning LoRAs, ...;
model/diffusers_pipeline/published.py: FLUX.1, FLUX.2-klein, Z-Image-Turbo, SD3.5, else the
diffusers pipeline class's own `__call__` defaults, with its text length), or ditfleet's own. The job's values win; where it says nothing a recognised checkpoint's published
schedule (steps, CFG off, its scheduler) is the default; `ditfleet plan` and `_job.json` say which.

Read at plan time without torch and without weights: the checkpoint's scheduler config (a local
folder, the bundled model, or s3://), the LoRA file names and an hf:// id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditfleet.model.family import (
    SCHEDULER_FILE,
    PublishedDefaults,
    PublishedSchedule,
    model_family,
    schedule_by_checkpoint,
    schedule_by_hub_id,
    schedule_by_lora,
    schedule_by_scheduler,
    schedule_twins,
)
from ditfleet.workers.storage import S3Config, StoreError, open_store

# The sampling keys a checkpoint may give defaults for (workers.rows.RowConfig's names).
SAMPLING_KEYS = ("steps", "true_cfg_scale", "negative_prompt")
JOB = "job"
DITFLEET = "ditfleet default"


@dataclass(frozen=True)
class Recognised:
    schedule: PublishedSchedule | PublishedDefaults
    how: str  # "its LoRA file X", "its scheduler config P", "its hub id", "diffusers' X.__call__ defaults"


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling values a job runs with where rows say nothing, and where each came from."""

    values: dict[str, Any]  # SAMPLING_KEYS -> value
    sources: dict[str, str]  # SAMPLING_KEYS and "scheduler" -> JOB, DITFLEET or the checkpoint's line
    scheduler_config: str | None  # the scheduler replacing the checkpoint's (the job's or a LoRA's)
    checkpoint: Recognised | None = None
    notes: tuple[str, ...] = field(default=())  # what could not be read, and why
    # A diffusers checkpoint's text length (model.max_sequence_length where the job sets none)
    # and where it came from; None: the job's setting or ditfleet's default applies.
    max_sequence_length: tuple[int, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """What `plan --json` prints and `_job.json` records."""
        out: dict[str, Any] = {k: {"value": self.values[k], "from": self.sources[k]} for k in SAMPLING_KEYS}
        out["scheduler"] = {"value": self.scheduler_config, "from": self.sources["scheduler"]}
        out["checkpoint"] = self.checkpoint.schedule.name if self.checkpoint else None
        if self.max_sequence_length is not None:
            value, source = self.max_sequence_length
            out["max_sequence_length"] = {"value": value, "from": source}
        if self.guidance is not None:
            out["guidance"] = self.guidance
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def line(self) -> str:
        """One line for `plan`, the keys grouped by where they came from: "steps 4, true_cfg_scale
        1.0, negative_prompt None (checkpoint: ...); scheduler: the checkpoint's own"."""
        by_source: dict[str, list[str]] = {}
        for key in SAMPLING_KEYS:
            by_source.setdefault(self.sources[key], []).append(f"{key} {self.values[key]!r}")
        parts = [f"{', '.join(keys)} ({source})" for source, keys in by_source.items()]
        scheduler = self.scheduler_config or "the checkpoint's own"
        line = "; ".join(parts) + f"; scheduler: {scheduler} ({self.sources['scheduler']})"
        if self.max_sequence_length is not None:
            value, source = self.max_sequence_length
            line += f"; max_sequence_length {value} ({source})"
        if self.guidance is not None:
            line += f"; guidance_scale: {self.guidance}"
        return line

    @property
    def guidance(self) -> str | None:
        """How a diffusers pipeline's guidance_scale (true_cfg_scale here) acts, when known."""
        schedule = self.checkpoint.schedule if self.checkpoint else None
        return schedule.guidance if isinstance(schedule, PublishedDefaults) else None


def checkpoint_label(found: Recognised) -> str:
    return f"checkpoint: {found.schedule.name}, recognised by {found.how}"


def recognise(
    model_path: str, lora_paths: tuple[str, ...], scheduler_config: str | None, s3: S3Config | None
) -> tuple[Recognised | None, tuple[str, ...]]:
    """The published checkpoint a job's model is, if any (model/qwen_image/published/schedules.py says the
    order; a checkpoint run through diffusers: model/diffusers_pipeline/published.py), and notes on
    what could not be read or could not be told apart.

    A LoRA file name or a hub id names a checkpoint, so they are asked first; a scheduler config
    names only a trajectory, which two published checkpoints with other defaults may share (Flash
    and Lightning: a constant shift of 3). Recognised by its scheduler alone, such a checkpoint is
    taken by the spelling of its file, and a note names the twin and what to set to be sure."""
    if (diffusers := schedule_by_checkpoint(model_path, model_family(model_path))) is not None:
        return Recognised(*diffusers), ()
    for path in lora_paths:
        if (schedule := schedule_by_lora(path)) is not None:
            return Recognised(schedule, f"its LoRA file {path.rsplit('/', 1)[-1]}"), ()
    if model_path.startswith("hf://"):
        repo = model_path.removeprefix("hf://").split("@", 1)[0]
        if (schedule := schedule_by_hub_id(repo)) is not None:
            return Recognised(schedule, f"its hub id {repo}"), ()
    config, where, note = _scheduler_config(model_path, scheduler_config, s3)
    if (schedule := schedule_by_scheduler(config)) is not None:
        return Recognised(schedule, f"its scheduler config {where}"), _twins_note(schedule)
    return None, (note,) if note else ()


def _twins_note(schedule: PublishedSchedule) -> tuple[str, ...]:
    """What a recognition by the scheduler alone cannot tell (model.family.schedule_twins)."""
    twins = schedule_twins(schedule)
    if not twins:
        return ()
    others = ", ".join(f"{t.name} ({t.steps} steps)" for t in twins)
    return (
        f"its scheduler runs the trajectory that {others} runs too; it is taken for {schedule.name} "
        f"({schedule.steps} steps) by the spelling of its scheduler file alone (Flash's published file "
        "is reconstructed: model/qwen_image/published/qwen-image-flash/SOURCES.md). To be sure, set "
        "sampling.steps or name the model by its hub id (hf://...).",
    )


def _scheduler_config(
    model_path: str, override: str | None, s3: S3Config | None
) -> tuple[Any, str, str | None]:
    """(the scheduler config the model runs with, where it is, a note if it could not be read)."""
    bundled = model_family(model_path).bundled_dir
    where = override or (str(bundled / SCHEDULER_FILE) if bundled else f"{model_path}/{SCHEDULER_FILE}")
    try:
        if where.startswith("s3://"):
            if override:  # a file, or a folder holding one
                store = open_store(where.rsplit("/", 1)[0] if where.endswith(".json") else where, s3)
                key = where.rsplit("/", 1)[-1] if where.endswith(".json") else "scheduler_config.json"
            else:
                store, key = open_store(model_path, s3), SCHEDULER_FILE
            return json.loads(store.get(key)), where, None
        if "://" in where and not where.startswith("file://"):
            return None, where, None  # hf://: not fetched to plan a job; the hub id may name it
        path = Path(where.removeprefix("file://"))
        if path.is_dir():
            path = path / "scheduler_config.json"
        return json.loads(path.read_text()), str(path), None
    except (StoreError, OSError, ValueError) as e:
        return None, where, f"{where} not read ({type(e).__name__}: {e}); no published schedule recognised"


def resolve(
    given: dict[str, Any],
    ditfleet_defaults: dict[str, Any],
    found: Recognised | None,
    scheduler_config: str | None,
    notes: tuple[str, ...] = (),
    text_length_given: bool = False,
) -> SamplingDefaults:
    """`given`: the sampling keys the job sets; each other key takes the checkpoint's published
    default, else ditfleet's. The scheduler: the job's model.scheduler_config, else a recognised
    LoRA's published one, else the checkpoint's own. The text length (text_length_given: the job
    sets model.max_sequence_length): a diffusers checkpoint's published one, else the job's."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key in SAMPLING_KEYS:
        if key in given:
            values[key], sources[key] = given[key], JOB
        elif found is not None:
            values[key], sources[key] = found.schedule.defaults()[key], checkpoint_label(found)
        else:
            values[key], sources[key] = ditfleet_defaults[key], DITFLEET
    if scheduler_config is not None:
        sources["scheduler"] = JOB
    elif found is not None and found.schedule.lora_name is not None:
        scheduler_config, sources["scheduler"] = found.schedule.scheduler_uri(), checkpoint_label(found)
    else:
        sources["scheduler"] = "its scheduler/ folder"
    text_length = None
    schedule = found.schedule if found is not None else None
    if not text_length_given and isinstance(schedule, PublishedDefaults):
        value = schedule.text_length()
        text_length = (value, checkpoint_label(found)) if value is not None and found is not None else None
    return SamplingDefaults(values, sources, scheduler_config, found, notes, text_length)
