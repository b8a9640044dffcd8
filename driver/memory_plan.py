"""The memory plan of a job: does each of its buckets fit the GPU memory the job names?

Reads only the model's config files (a local folder, the bundled tiny model, or s3://), never
weights, and sizes every bucket at the job's batch size with the model family's memory formula
(`model.family`). A batch size that cannot fit is refused before any actor starts, naming the
largest one that does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

from ditfleet.compile.buckets import ResolutionBucket, planned_text_len

# model.loading.folder and model.memory read configs and safetensors headers without torch: planning a
# job (`ditfleet plan`) does not load it.
from ditfleet.model.family import (
    Size,
    family_of_class,
    model_family,
    resolve_model_dir,
    source_prompt_tokens,
)
from ditfleet.model.memory import GB, TEXT_ENCODER_PLACEMENTS, MemoryPlan, ModelMemory, Runtime
from ditfleet.model.settings import DEFAULT_PIPELINE, MAX_SEQUENCE_LENGTH, Fp8Layers, Quantization
from ditfleet.workers.storage import ObjectNotFound, S3Config, StoreError, open_store

# The GPU sizes the plan shows the largest batch for: 80 GB (A100/H100), 48 GB (L40S, A6000),
# 24 GB (L4, A10G); an actor itself sizes its batch from its own GPU (workers.batch_fit).
GPU_SIZES_GB = (80.0, 48.0, 24.0)


class MemoryPlanError(ValueError):
    """A job whose batch cannot fit the GPU memory it names; the message says what would."""


@dataclass(frozen=True)
class MemoryRequest:
    """What the job asks of one GPU actor (built by jobs/ from the spec)."""

    model_path: str  # "tiny", a local folder, s3://bucket/prefix or hf://org/name@rev
    buckets: tuple[str, ...]  # 'WxH'
    batch_size: int
    dtype: str = "bf16"  # bf16 | fp32
    text_encoder: str = "gpu"  # gpu | cpu | offload
    gpu_memory_gb: float | None = None  # None: print the plan, check nothing
    cfg: str = "serial"  # serial | off
    vae_batch: int | None = 1  # images per VAE decode call; None: the whole batch
    max_sequence_length: int = MAX_SEQUENCE_LENGTH
    table_steps: tuple[int, ...] = ()  # schedules kept per bucket in "table" modulation mode
    s3: S3Config | None = None
    device: str = "cuda"  # cuda | cpu (an actor without a GPU: the plan is of host memory)
    quantization: Quantization = "none"  # the DiT's weights
    fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers  # which of its Linears are FP8
    step_cache_tensors: int = 0  # image-stream tensors a step cache keeps per CFG branch
    vqa: bool = False  # quality.scorers (or the gate) asks vqa of the text encoder
    # An edit job's sources per row, (width, height) each as read: their tokens in every DiT
    # forward, their VAE encode (model.memory.plan_memory's `sources`) and their vision tokens in
    # the prompt (model.family.source_prompt_tokens); () for a text job, before planning an edit
    # job's workers.sources.planned_sources. `bucket_sources` (the plan's heaviest row per bucket,
    # driver.plan.JobPlan.sources_per_bucket) overrides it per bucket.
    sources: tuple[Size, ...] = ()
    bucket_sources: Mapping[str, tuple[Size, ...]] = field(default_factory=dict, hash=False)

    @property
    def text_len(self) -> int:
        return self.text_len_for(self.sources)

    def sources_for(self, bucket: str | None) -> tuple[Size, ...]:
        return tuple(self.bucket_sources.get(bucket, self.sources)) if bucket is not None else self.sources

    def text_len_for(self, sources: tuple[Size, ...]) -> int:
        """The prompt length the DiT sees: the instruction's (up to max_sequence_length) and, for an
        edit, the vision tokens its sources add (an edit prompt is not cut: the model's side),
        padded to its prompt-length bucket; past the largest bucket, as long as it is."""
        return planned_text_len(self.max_sequence_length + source_prompt_tokens(self.model_path, sources))


@dataclass(frozen=True)
class JobMemoryPlan:
    model: ModelMemory
    request: MemoryRequest
    plans: tuple[MemoryPlan, ...]  # one per bucket, at the job's batch size
    largest: dict[str, int]  # bucket -> largest batch that fits (only with gpu_memory_gb)

    @property
    def fits(self) -> bool | None:
        if self.request.gpu_memory_gb is None:
            return None
        return all(p.fits for p in self.plans)

    def worst(self) -> MemoryPlan:
        return max(self.plans, key=lambda p: p.peak)

    def placements(self) -> tuple[str, ...]:
        """The text-encoder placements that mean something for this model (one without a text
        encoder has only the DiT and the VAE on the GPU)."""
        return TEXT_ENCODER_PLACEMENTS if "text_encoder" in self.model.params() else ("gpu",)

    def largest_by_gpu(
        self, sizes_gb: tuple[float, ...] = GPU_SIZES_GB
    ) -> dict[str, dict[str, dict[str, int]]]:
        """bucket -> GPU size -> text-encoder placement -> the largest batch that fits (0: none),
        whatever the job's own gpu_memory_gb: a fleet of mixed GPUs takes each GPU's own batch
        (workers.batch_fit), and this says what each size gets. Empty for a CPU job."""
        if self.request.device != "cuda":
            return {}
        memory = model_family(self.request.model_path).memory
        out: dict[str, dict[str, dict[str, int]]] = {}
        for p in self.plans:
            row = out.setdefault(f"{p.width}x{p.height}", {})
            for gb in sizes_gb:
                row[f"{gb:g}"] = {
                    te: memory.largest_batch(
                        self.model, gb, height=p.height, width=p.width,
                        **plan_kwargs(self.request, f"{p.width}x{p.height}", text_encoder=te),
                    )
                    for te in self.placements()
                }  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "params": self.model.params(),
            "quantization": self.request.quantization,
            "gpu_memory_gb": self.request.gpu_memory_gb,
            "fits": self.fits,
            "largest_batch": self.largest,
            "largest_batch_by_gpu": self.largest_by_gpu(),
            "buckets": [p.to_dict() for p in self.plans],
        }

    def lines(self) -> list[str]:
        first = self.plans[0]
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f} GB" for k, v in first.weights.items())
        dit = f", DiT {first.quantization}" if first.quantization != "none" else ""
        out = [f"{self.model.name} in {first.dtype}{dit}: {parts}"]
        for p in self.plans:
            bucket = f"{p.width}x{p.height}"
            tail = f" (largest batch that fits: {self.largest[bucket]})" if bucket in self.largest else ""
            out.append(p.describe() + tail)
        by_gpu = self.largest_by_gpu()
        if by_gpu:
            out.append(f"largest batch per GPU size (text encoder {' / '.join(self.placements())}):")
            for bucket, sizes in by_gpu.items():
                cells = ", ".join(
                    f"{gb} GB {'/'.join(str(n) for n in te.values())}" for gb, te in sizes.items()
                )
                out.append(f"  {bucket}: {cells}")
        if first.host:
            out.append(f"host memory per actor: {first.host / GB:.1f} GB (text encoder off the GPU)")
        if self.request.vqa:
            out.append(self._vqa_line())
        return out

    def _vqa_line(self) -> str:
        """Where vqa's forward runs and, on the GPU, what its phase holds at the largest bucket."""
        scored = [p for p in self.plans if "score" in p.phases]
        if not scored:
            return (
                f"vqa: runs where the text encoder is (model.text_encoder: {self.request.text_encoder}), "
                "on the host: no GPU memory, but host time per image (docs/performance.md)"
            )
        p = max(scored, key=lambda p: p.activations["score"])
        return (
            f"vqa: one text-encoder forward per image after the decode, {p.activations['score'] / GB:.2f} GB "
            f"of activations at {p.width}x{p.height} (score phase {p.phases['score'] / GB:.1f} GB)"
        )

    def check(self, where: str) -> None:
        """Raise MemoryPlanError naming each bucket whose batch does not fit."""
        problems = []
        r = self.request
        for p in self.plans:
            if p.fits is not False:
                continue
            bucket = f"{p.width}x{p.height}"
            need = f"needs {p.peak / GB:.1f} GB at its {p.peak_phase} peak"
            best = self.largest[bucket]
            if best:
                problems.append(
                    f"bucket {bucket}: workers.batch_size {r.batch_size} {need}; the largest batch that fits "
                    f"{r.gpu_memory_gb:g} GB is {best}"
                )
            else:
                hint = (
                    "set model.text_encoder: offload (or cpu) to keep the text encoder off the GPU, "
                    "or use a GPU with more memory"
                    if r.text_encoder == "gpu" and "text_encoder" in p.weights
                    else "use a GPU with more memory"
                )
                if r.quantization == "none" and self._fits_under_fp8(p):
                    hint += (
                        "; model.quantization: fp8 (fp8-weight-only on a GPU without FP8 units) halves the "
                        "DiT's weights and fits (docs/real-model.md)"
                    )
                problems.append(
                    f"bucket {bucket}: not even batch 1 fits {r.gpu_memory_gb:g} GB ({need}, weights "
                    f"{sum(p.weights.values()) / GB:.1f} GB); {hint}"
                )
        if problems:
            raise MemoryPlanError(
                f"{where}: the job does not fit workers.gpu_memory_gb {r.gpu_memory_gb:g}:\n"
                + "\n".join(f"  {line}" for line in problems)
            )

    def _fits_under_fp8(self, plan: MemoryPlan) -> bool:
        memory = model_family(self.request.model_path).memory
        kwargs = plan_kwargs(self.request, f"{plan.width}x{plan.height}", quantization="fp8")
        fp8 = memory.plan(
            self.model, height=plan.height, width=plan.width, batch=1,
            gpu_memory_gb=self.request.gpu_memory_gb, **kwargs,
        )  # fmt: skip
        return bool(fp8.fits)


def read_model_memory(model_path: str, s3: S3Config | None = None) -> ModelMemory | None:
    """The model's configs, read without weights; None for hf:// (not readable at plan time) and
    for a family whose memory is not a formula of its configs."""
    scheme = urlparse(model_path).scheme
    if scheme == "hf":
        return None
    memory = model_family(model_path).memory
    if not getattr(memory, "plans_from_configs", True):
        return None  # measured at warm-up on the actor (a diffusers pipeline: model.diffusers_pipeline)
    if scheme == "s3":
        store = open_store(model_path, s3)

        def get(key: str, required: bool = True) -> dict | None:
            try:
                return json.loads(store.get(key))
            except ObjectNotFound:
                if required:
                    raise StoreError(
                        f"{store.uri(key)}: missing; a model folder needs transformer/ and vae/ configs"
                    ) from None
                return None
            except json.JSONDecodeError as e:
                raise ValueError(f"{store.uri(key)}: not valid JSON ({e})") from e

        index = get("model_index.json", required=False)
        if isinstance(index, dict):
            # The checkpoint's own family (one a pipeline without a native family runs through
            # diffusers: refused here, before any work, when it cannot run; measured, not planned).
            family = family_of_class(index.get("_class_name"), store.uri("model_index.json"), index)
            memory = family.memory
            if not getattr(memory, "plans_from_configs", True):
                return None
        return memory.from_configs(
            get("transformer/config.json"),  # type: ignore[arg-type]
            get("vae/config.json"),  # type: ignore[arg-type]
            get("text_encoder/config.json", required=False),
            name=model_path,
            where=model_path,
        )
    path = model_path.removeprefix("file://")
    return memory.from_dir(resolve_model_dir(path), name=model_path)


def plan_kwargs(request: MemoryRequest, bucket: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The memory formula's keyword arguments for `request` (all but the size, batch and GPU) at
    `bucket` ('WxH': its sources, request.sources_for); `overrides` replace fields of its Runtime."""
    sources = request.sources_for(bucket)
    run = Runtime(
        dtype=request.dtype,
        text_encoder=request.text_encoder,
        cfg=request.cfg,
        vae_batch=request.vae_batch,
        text_len=request.text_len_for(sources),
        modulation_table_steps=request.table_steps,
        device=request.device,
        quantization=request.quantization,
        fp8_layers=request.fp8_layers,
        vqa=request.vqa,
    )
    return dict(run=replace(run, **overrides), step_cache_tensors=request.step_cache_tensors, sources=sources)


def job_memory_plan(request: MemoryRequest, model: ModelMemory | None = None) -> JobMemoryPlan | None:
    """Plan every bucket of the job; None when the model cannot be read at plan time (hf://)."""
    model = model or read_model_memory(request.model_path, request.s3)
    if model is None:
        return None
    memory = model_family(request.model_path).memory
    plans, largest = [], {}
    for name in request.buckets:
        b = ResolutionBucket.parse(name)
        kwargs = plan_kwargs(request, b.name)
        plans.append(
            memory.plan(
                model, height=b.height, width=b.width, batch=request.batch_size,
                gpu_memory_gb=request.gpu_memory_gb, **kwargs,
            )
        )  # fmt: skip
        if request.gpu_memory_gb is not None:
            largest[b.name] = memory.largest_batch(
                model, request.gpu_memory_gb, height=b.height, width=b.width, **kwargs
            )
    return JobMemoryPlan(model, request, tuple(plans), largest)
