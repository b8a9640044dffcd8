"""The batch an actor runs: the largest its own GPU fits, never above the job's workers.batch_size.

A fleet may mix GPU sizes (80 GB and 48 GB nodes in one job). `workers.batch_size` is what the
job asks for; each actor sizes its own batch at start-up from the same memory formula the plan
uses (`model.family`'s, `model.memory`) and its device's total memory, so a 48 GB actor takes a
smaller batch instead of failing with out-of-memory errors. On the CPU the batch is the job's.

The plan's arguments mirror `jobs.spec.job.JobSpec.memory_request` (the driver's side of the
same question); tests/unit/workers/test_batch_fit.py checks the two give the same batch.

Batched kernels round differently from unbatched ones, so images of one prompt and seed made
at batch 10 and at batch 47 agree only to rounding level (docs/real-model.md); each manifest
row records the batch size its actor ran with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ditfleet.compile.buckets import planned_text_len
from ditfleet.model.family import Size, model_family, source_prompt_tokens
from ditfleet.model.generation.guidance import planned_cfg
from ditfleet.model.memory import GB, Runtime
from ditfleet.model.quality.table import PIPELINE_QWEN_VL, needing
from ditfleet.model.settings import resolve_modulation_cache
from ditfleet.workers.contract import WorkerConfig
from ditfleet.workers.sources import planned_sources


class BatchFitError(RuntimeError):
    """Not even one image of a job's bucket fits this actor's GPU; the message says what would."""


@dataclass(frozen=True)
class BatchFit:
    """What an actor decided: `batch_size` it runs, the job's, and why (JSON-able via to_dict)."""

    batch_size: int
    job_batch_size: int
    gpu_memory_gb: float | None = None  # None: on the CPU, or the plan could not be made
    limited_by: str | None = None  # the bucket whose largest batch set batch_size, if below the job's
    largest: dict[str, int] | None = None  # bucket -> the largest batch this GPU fits
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_memory(device: torch.device) -> tuple[str, int]:
    """The GPU's name and total memory in bytes (the one place an actor reads them: tests fake it)."""
    props = torch.cuda.get_device_properties(device)
    return props.name, int(props.total_memory)


def plan_runtime(
    config: WorkerConfig,
    dtype: torch.dtype,
    model_dir: str | Path | None = None,
    sources: tuple[Size, ...] = (),
) -> Runtime:
    """How this actor runs a batch, for the memory formula, as the job's plan builds it; an edit
    batch's `sources` (by default workers.sources.planned_sources) add their vision tokens (as the
    checkpoint at `model_dir` gives them) to the prompt length."""
    sources = sources or planned_sources(config.rows.image_column)
    vision = source_prompt_tokens(model_dir, sources) if model_dir is not None else 0
    return Runtime(
        dtype="fp32" if dtype == torch.float32 else "bf16",
        text_encoder=config.placement.text_encoder,
        cfg=planned_cfg(config.rows.true_cfg_scale),
        vae_batch=1 if config.compile.vae_on("cuda") else None,
        text_len=planned_text_len(config.pipeline.max_sequence_length + vision),
        modulation_table_steps=(config.rows.steps,)
        if resolve_modulation_cache(config.pipeline.modulation_cache, "cuda") == "table"
        else (),
        device="cuda",
        quantization=config.pipeline.quantization,
        fp8_layers=config.pipeline.fp8_layers,
        vqa=bool(needing(config.scorer_names, PIPELINE_QWEN_VL)),  # its forward on the text encoder
    )


def fit_batch_size(
    config: WorkerConfig, model_dir: str | Path, device: torch.device, dtype: torch.dtype
) -> BatchFit:
    """The batch this actor runs: the smallest over the job's buckets of the largest batch that
    fits this GPU, capped at config.batch_size. Reads the model's configs only (no weights).

    Raises BatchFitError when not even batch 1 of some bucket fits: the actor would only fail
    each batch with out-of-memory errors (and the driver then names this GPU)."""
    job = config.batch_size
    if device.type != "cuda":
        return BatchFit(job, job, note="cpu: the job's batch size")
    gpu_name, total = device_memory(device)
    capacity_gb = total / GB
    family = model_family(config.model_path)
    try:
        model = family.memory.from_dir(model_dir, name=config.model_path)
    except (OSError, ValueError, KeyError) as e:
        # A model the formula cannot size: run the job's batch.
        return BatchFit(job, job, round(capacity_gb, 1), note=f"no memory plan ({e}); the job's batch size")
    # what the step cache keeps per branch, as the driver's plan counts it (jobs.spec.job.memory_request)
    cache = config.pipeline.step_cache
    step_cache_tensors = cache.kept_tensors() if cache is not None else 0
    largest: dict[str, int] = {}
    for name in config.warmup_buckets or config.rows.buckets.names:
        b = config.rows.buckets.get(name)
        # an edit job's heaviest row's sources in this bucket, as planned (else planned_sources)
        sources = tuple(config.bucket_sources.get(b.name, ())) or planned_sources(config.rows.image_column)
        largest[b.name] = family.memory.largest_batch(
            model, capacity_gb, limit=job, height=b.height, width=b.width,
            run=plan_runtime(config, dtype, model_dir, sources), sources=sources,
            step_cache_tensors=step_cache_tensors,
        )  # fmt: skip
    if not largest:
        return BatchFit(job, job, round(capacity_gb, 1), note="no buckets")
    bucket = min(largest, key=lambda k: largest[k])
    best = largest[bucket]
    if best == 0:
        raise BatchFitError(
            f"this GPU ({gpu_name}, {capacity_gb:.1f} GB) cannot fit one "
            f"image of bucket {bucket} ({config.pipeline.quantization} DiT, text encoder "
            f"{config.placement.text_encoder}) by the memory plan; `ditfleet plan` shows what each GPU "
            "size fits. Use larger GPUs, model.text_encoder: offload or cpu, or model.quantization: fp8"
        )
    return BatchFit(
        min(best, job),
        job,
        round(capacity_gb, 1),
        limited_by=bucket if best < job else None,
        largest=largest,
        note="" if best >= job else f"{capacity_gb:.1f} GB fits {best} at bucket {bucket}",
    )
