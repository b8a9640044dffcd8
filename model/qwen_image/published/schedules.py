"""The sampling defaults the publishers of Qwen-Image checkpoints give (steps, CFG on or off, and
the schedule), and how ditfleet recognises each checkpoint from its files. Torch-free: the job
spec resolves its defaults from these when it plans (`ditfleet plan` says which came from where).

A checkpoint is recognised, in this order, by
- a LoRA file named as its publisher names it (`Qwen-Image-Lightning-8steps-V2.0.safetensors`):
  the LoRA brings its schedule (`scheduler`, a published folder here) over the base model;
- its scheduler config (the checkpoint's `scheduler/scheduler_config.json`, or the job's
  `model.scheduler_config`): the schedule-shaping keys (`schedule_key`) equal to a published one;
- its hub id (`hf://nvidia/Qwen-Image-Flash@...`).
A LoRA file or a hub id names a checkpoint; a scheduler config only its trajectory. Flash and
Lightning run the same trajectory (a constant shift of 3: Flash's file spells it `shift: 3.0`,
Lightning's as a dynamic shift between two equal values, log 3), and Flash's file here is a
reconstruction (qwen-image-flash/SOURCES.md), so the spelling alone cannot be trusted to tell
them apart: a recognition by the scheduler alone whose trajectory another published checkpoint
with other defaults shares says so (`trajectory_twins`), and a hub id is asked first.
Qwen/Qwen-Image and Qwen/Qwen-Image-2512 publish 50 steps at true CFG scale 4.0, which are
ditfleet's own defaults (workers.rows.RowConfig); they are named by their hub id only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditfleet.model.qwen_image.published import PUBLISHED

SCHEDULER_FILE = "scheduler/scheduler_config.json"
PUBLISHED_SCHEME = "published"  # published:<folder>/<file>: a file of this folder, on any node


def published_file(uri: str) -> Path:
    """The file a `published:<folder>/<file>` URI names, in this node's installed package;
    ValueError for a name outside the published folder."""
    rel = uri.removeprefix(f"{PUBLISHED_SCHEME}:")
    path = (PUBLISHED / rel).resolve()
    if rel == uri or not path.is_relative_to(PUBLISHED.resolve()) or not path.is_file():
        raise ValueError(
            f"{uri!r}: not a published config file (published:<folder>/<file> under {PUBLISHED})"
        )
    return path


@dataclass(frozen=True)
class PublishedSchedule:
    """What a checkpoint's publisher gives for sampling it; SOURCES.md in `folder` says where from."""

    name: str  # as its publisher names it
    steps: int
    true_cfg_scale: float  # 1.0: CFG distilled in, one DiT pass per step
    negative_prompt: str | None  # None: no negative prompt, so CFG stays off even for a row's scale
    folder: str  # its published folder here (model/qwen_image/published/<folder>/scheduler/)
    hub_ids: tuple[str, ...] = ()  # hf://<id> names it
    lora_name: str | None = None  # a regular expression its LoRA files' names match

    def scheduler_path(self) -> str:
        """The published scheduler_config.json of this checkpoint, on this machine."""
        return str(PUBLISHED / self.folder / SCHEDULER_FILE)

    def scheduler_uri(self) -> str:
        """The same file as a job hands it to its actors: `published:<folder>/...`, which each
        node resolves in its own installed package (published_file), wherever that is."""
        return f"{PUBLISHED_SCHEME}:{self.folder}/{SCHEDULER_FILE}"

    def defaults(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "true_cfg_scale": self.true_cfg_scale,
            "negative_prompt": self.negative_prompt,
        }


FLASH = PublishedSchedule(
    "nvidia/Qwen-Image-Flash", 4, 1.0, None, "qwen-image-flash", hub_ids=("nvidia/Qwen-Image-Flash",)
)
# A merged Lightning checkpoint ships Lightning's scheduler; the 8-step one is what its publisher's
# script runs by default (a 4-step merge takes sampling.steps: 4).
LIGHTNING = PublishedSchedule("Qwen-Image-Lightning (8 steps)", 8, 1.0, None, "qwen-image-lightning")
LIGHTNING_LORAS = (
    PublishedSchedule(
        "Qwen-Image-Lightning 4-step LoRA", 4, 1.0, None, "qwen-image-lightning",
        lora_name=r"qwen-image-lightning-4steps-.*\.safetensors",
    ),
    PublishedSchedule(
        "Qwen-Image-Lightning 8-step LoRA", 8, 1.0, None, "qwen-image-lightning",
        lora_name=r"qwen-image-lightning-8steps-.*\.safetensors",
    ),
)  # fmt: skip
# Recognised by their scheduler config, in this order.
BY_SCHEDULER = (FLASH, LIGHTNING)
# Qwen-Image and its December 2025 retrain publish 50 steps at true CFG scale 4.0 with a blank
# negative prompt (their cards' example), which are ditfleet's own defaults; their scheduler is
# the same file, so only the hub id tells them apart (plan then names the checkpoint).
QWEN_IMAGE = PublishedSchedule("Qwen/Qwen-Image", 50, 4.0, " ", "qwen-image", hub_ids=("Qwen/Qwen-Image",))
QWEN_IMAGE_2512 = PublishedSchedule(
    "Qwen/Qwen-Image-2512", 50, 4.0, " ", "qwen-image-2512", hub_ids=("Qwen/Qwen-Image-2512",)
)

# The keys of a FlowMatchEulerDiscreteScheduler config that shape the schedule (model.generation.
# scheduler computes them); with a static shift the dynamic keys do not count.
_DYNAMIC_KEYS = ("time_shift_type", "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")


def schedule_key(config: dict[str, Any]) -> tuple:
    """What in a scheduler config shapes the schedule, comparable across files that spell the
    same schedule with other bookkeeping keys."""
    dynamic = bool(config.get("use_dynamic_shifting", False))
    shaping = _DYNAMIC_KEYS if dynamic else ("shift",)
    return (dynamic, config.get("shift_terminal"), *(config.get(k) for k in shaping))


def published_scheduler(schedule: PublishedSchedule) -> dict[str, Any]:
    return json.loads((PUBLISHED / schedule.folder / SCHEDULER_FILE).read_text())


def by_scheduler(config: Any) -> PublishedSchedule | None:
    """The published checkpoint whose scheduler config shapes the same schedule as `config`."""
    if not isinstance(config, dict):
        return None
    key = schedule_key(config)
    return next((s for s in BY_SCHEDULER if schedule_key(published_scheduler(s)) == key), None)


def constant_shift(config: dict[str, Any]) -> float | None:
    """The shift of a schedule whose shift does not depend on the image size: `shift` when static;
    with dynamic shifting between equal `base_shift` and `max_shift` (mu), e^mu ("exponential") or
    mu ("linear"), which shape exactly the sigmas of that static shift (model.generation.scheduler:
    a / (a + 1/s - 1) = a s / (1 + (a - 1) s)). None when it depends on the size."""
    if not config.get("use_dynamic_shifting", False):
        shift = config.get("shift", 1.0)
        return float(shift) if isinstance(shift, (int, float)) else None
    base, top = config.get("base_shift"), config.get("max_shift")
    if not isinstance(base, (int, float)) or not isinstance(top, (int, float)) or not math.isclose(base, top):
        return None
    kind = config.get("time_shift_type", "exponential")
    return math.exp(base) if kind == "exponential" else float(base) if kind == "linear" else None


def trajectory(config: dict[str, Any]) -> tuple | None:
    """What the sigmas of a scheduler config are, however it spells them: (terminal sigma, its
    constant shift to 9 digits); None when the shift depends on the image size."""
    shift = constant_shift(config)
    return None if shift is None else (config.get("shift_terminal"), round(shift, 9))


def trajectory_twins(schedule: PublishedSchedule) -> tuple[PublishedSchedule, ...]:
    """The other published checkpoints recognised by their scheduler whose scheduler shapes the
    same trajectory as `schedule`'s with other defaults (Flash's 4 steps, Lightning's 8): a
    scheduler config alone cannot tell those apart."""
    mine = trajectory(published_scheduler(schedule))
    return tuple(
        other
        for other in BY_SCHEDULER
        if other is not schedule
        and other.folder != schedule.folder
        and mine is not None
        and trajectory(published_scheduler(other)) == mine
        and other.defaults() != schedule.defaults()
    )


def by_lora(file_name: str) -> PublishedSchedule | None:
    """The published LoRA a file of this name is (the name as its publisher ships it)."""
    name = file_name.rsplit("/", 1)[-1].lower()
    return next((s for s in LIGHTNING_LORAS if s.lora_name and re.fullmatch(s.lora_name, name)), None)


def by_hub_id(repo_id: str) -> PublishedSchedule | None:
    every = (*BY_SCHEDULER, QWEN_IMAGE, QWEN_IMAGE_2512)
    return next((s for s in every if repo_id.lower() in (h.lower() for h in s.hub_ids)), None)
