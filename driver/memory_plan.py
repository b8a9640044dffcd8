"""The memory plan of a job: does each of its buckets fit the GPU memory the job names?

Reads only the model's config files (a local folder, the bundled tiny model, or s3://), never
weights, and sizes every bucket at the job's batch size with the model family's memory formula
(`model.family`). A batch size that cannot fit is refused before any actor starts, naming the
largest one that does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ditfleet.compile.buckets import PROMPT_LENGTH_BUCKETS, ResolutionBucket, prompt_length_bucket

# model.folder and model.memory read configs and safetensors headers without torch: planning a
# job (`ditfleet plan`) does not load it.
from ditfleet.model.family import model_family
from ditfleet.model.folder import resolve_model_dir
from ditfleet.model.memory import GB, MemoryPlan, ModelMemory
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH
from ditfleet.workers.storage import ObjectNotFound, S3Config, StoreError, open_store


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
    quantization: str = "none"  # the DiT's weights: none | fp8 | fp8-weight-only

    @property
    def text_len(self) -> int:
        return prompt_length_bucket(self.max_sequence_length, PROMPT_LENGTH_BUCKETS)


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "params": self.model.params(),
            "gpu_memory_gb": self.request.gpu_memory_gb,
            "fits": self.fits,
            "largest_batch": self.largest,
            "buckets": [p.to_dict() for p in self.plans],
        }

    def lines(self) -> list[str]:
        first = self.plans[0]
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f} GB" for k, v in first.weights.items())
        out = [f"{self.model.name} in {first.dtype}: {parts}"]
        for p in self.plans:
            bucket = f"{p.width}x{p.height}"
            tail = f" (largest batch that fits: {self.largest[bucket]})" if bucket in self.largest else ""
            out.append(p.describe() + tail)
        if first.host:
            out.append(f"host memory per actor: {first.host / GB:.1f} GB (text encoder off the GPU)")
        return out

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
                problems.append(
                    f"bucket {bucket}: not even batch 1 fits {r.gpu_memory_gb:g} GB ({need}, weights "
                    f"{sum(p.weights.values()) / GB:.1f} GB); {hint}"
                )
        if problems:
            raise MemoryPlanError(
                f"{where}: the job does not fit workers.gpu_memory_gb {r.gpu_memory_gb:g}:\n"
                + "\n".join(f"  {line}" for line in problems)
            )


def read_model_memory(model_path: str, s3: S3Config | None = None) -> ModelMemory | None:
    """The model's configs, read without weights; None for hf:// (not readable at plan time)."""
    scheme = urlparse(model_path).scheme
    if scheme == "hf":
        return None
    memory = model_family(model_path).memory
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

        return memory.from_configs(
            get("transformer/config.json"),  # type: ignore[arg-type]
            get("vae/config.json"),  # type: ignore[arg-type]
            get("text_encoder/config.json", required=False),
            name=model_path,
            where=model_path,
        )
    path = model_path.removeprefix("file://")
    return memory.from_dir(resolve_model_dir(path), name=model_path)


def job_memory_plan(request: MemoryRequest, model: ModelMemory | None = None) -> JobMemoryPlan | None:
    """Plan every bucket of the job; None when the model cannot be read at plan time (hf://)."""
    model = model or read_model_memory(request.model_path, request.s3)
    if model is None:
        return None
    memory = model_family(request.model_path).memory
    kwargs: dict[str, Any] = dict(
        dtype=request.dtype,
        text_encoder=request.text_encoder,
        cfg=request.cfg,
        vae_batch=request.vae_batch,
        text_len=request.text_len,
        modulation_table_steps=request.table_steps,
        device=request.device,
        quantization=request.quantization,
    )
    plans, largest = [], {}
    for name in request.buckets:
        b = ResolutionBucket.parse(name)
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
