"""The sections of a job file (input, output, model, sampling, buckets, compile, workers, shards,
s3, cost): one pydantic model each, every field saying why it exists.

A knob field is `key: <its dataclass field's type> = knob(Dataclass, "field")` (jobs/spec/derive.py):
default, bounds and description come from the dataclass, and a test checks the type is the same.
A default of the spec's own is `Field(default=...)`: type checkers take only the keyword for one.

Unknown keys are errors (`extra="forbid"`): a typo in a job file must not be silently ignored.
Fields are checked here, one section at a time; what spans sections is checked by `JobSpec`.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ditfleet.compile.buckets import BucketSet
from ditfleet.compile.config import CompileConfig, OnOffAuto
from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.output.cost import CostConfig
from ditfleet.driver.plan import PlanConfig
from ditfleet.model.cfg_table import CfgTable
from ditfleet.model.loading.folder import TINY_MODEL
from ditfleet.model.quality.table import ScorerName
from ditfleet.model.settings import (
    AttentionBackend,
    CfgMode,
    Fp8Layers,
    ModulationCache,
    PipelineSettings,
    Quantization,
)
from ditfleet.model.step_cache_config import StepCacheConfig, check_schedule
from ditfleet.workers.cache_secret import WELL_KNOWN_ENV, CacheSecretSource
from ditfleet.workers.contract import Device, Dtype, GateConfig, ModelPlacement, Placement, WorkerConfig
from ditfleet.workers.output.formats import FormatName, ShardWriterConfig
from ditfleet.workers.output.layout import ImageFormat
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import S3Config
from ditfleet.workers.storage.base import AddressingStyle
from ditfleet.workers.storage.input_files import check_s3_uri
from ditfleet.workers.weights.licence import check_licence_id

from .derive import knob


class Section(BaseModel):
    # allow_inf_nan: every float of the job file is finite (.nan, .inf refused naming the key), as
    # model.settings.check_settings holds every knob below the spec.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # Frozen: a spec is validated as a whole, once. Pydantic's own refusal says only
        # "Instance is frozen"; this one says how to change it.
        raise TypeError(
            f"{type(self).__name__}.{name}: a JobSpec is frozen; make a changed copy, validated again, "
            "with spec.with_changes(section={'key': value}), e.g. spec.with_changes(sampling={'steps': 10})"
        )


def _plain_s3_uri(uri: str) -> str:
    return check_s3_uri(uri, "path")


def _node_file(path: str) -> str:
    """One file every node can read: s3://bucket/key (fetched into each node's model cache) or a
    local path that every node sees (file:///x means /x)."""
    if path.startswith("s3://"):
        return check_s3_uri(path, "path")
    if path.startswith("file://"):
        path = path.removeprefix("file://")
    if "://" in path:
        raise ValueError(
            f"{path!r}: give s3://bucket/key or a local path that every node sees (a shared filesystem, "
            "or baked into the node image)"
        )
    if not path:
        raise ValueError("must not be empty")
    return path


class LoraAdapterSpec(Section):
    path: str = Field(
        description="A LoRA .safetensors file for the DiT, in the diffusers/PEFT layout "
        "(transformer.<layer>.lora_A/lora_B) or the kohya/ComfyUI one (lora_down/lora_up, alpha). "
        "s3://bucket/key (fetched once per node into model.cache_dir) or a local path every node sees; "
        "relative paths start at the current directory."
    )
    scale: float = Field(
        default=1.0,
        ge=-8.0,
        le=8.0,
        description="Strength of the adapter: its update is multiplied by this (diffusers' adapter weight).",
    )

    _path_ok = field_validator("path")(_node_file)


# The prompts: the spec's own location fields next to the columns rows are read from
# (workers.rows.RowConfig).
class InputSpec(Section):
    path: str = Field(
        description="The prompt Parquet: a file, a directory of *.parquet files, or a glob "
        "('prompts/**/*.parquet'); local or s3://bucket/key. Relative paths start at the current directory."
    )
    prompt_column: str = knob(RowConfig, "prompt_column")
    id_column: str = knob(RowConfig, "id_column")
    image_column: str | None = knob(RowConfig, "image_column")
    max_source_mb: int = knob(RowConfig, "max_source_mb")
    max_source_megapixels: int = knob(RowConfig, "max_source_megapixels")
    incremental: bool = Field(
        default=False,
        description="The input grows (a new file lands every night): each run generates only the rows "
        "the output does not have yet, keyed by id (rows without an id column by file name and row), "
        "and adds shards next to the earlier ones. Off: the output belongs to exactly the files it was "
        "started with, and a grown input is refused. Ids of rows without an id column differ between "
        "the two modes, so the mode of an output cannot change.",
    )

    _path_ok = field_validator("path")(_plain_s3_uri)


# Where results go: the spec's own location fields next to the shard writer's knobs
# (workers.output.formats.ShardWriterConfig; its output_format is `format` in the job file).
class OutputSpec(Section):
    uri: str = Field(
        description="Where images, manifests, _job.json and _SUCCESS go: a local directory or "
        "s3://bucket/prefix. Running again with the same output resumes the job."
    )
    format: FormatName = knob(ShardWriterConfig, "output_format")
    image_format: ImageFormat = knob(ShardWriterConfig, "image_format")
    quality: int | None = knob(ShardWriterConfig, "quality")
    embed_metadata: bool = knob(ShardWriterConfig, "embed_metadata")
    shared_filesystem: bool = Field(
        default=False,
        description="A local output path is on a filesystem every node mounts at the same place "
        "(NFS, EFS, Lustre). Without it a local output is refused on a cluster of more than one "
        "node: each node would write to its own disk.",
    )

    _uri_ok = field_validator("uri")(_plain_s3_uri)

    @model_validator(mode="after")
    def _quality_needs_lossy(self) -> OutputSpec:
        if self.quality is not None and self.image_format == "png":
            raise ValueError("quality applies to webp and jpeg only; drop it or choose another image_format")
        return self


# The model, its numerics and its placement: the pipeline's knobs (model.settings) and where an
# actor puts it (workers.contract), next to the spec's own path and adapter fields. cfg_mode and
# step_cache are pipeline knobs too, shown under sampling.
class ModelSpec(Section):
    path: str = Field(
        default=TINY_MODEL,
        description="'tiny' (the bundled small model), 'tiny-edit' (its edit variant), a local directory in the diffusers layout, "
        "s3://bucket/prefix (that layout in a bucket) or hf://org/name@revision (needs the 'hub' extra).",
    )
    cache_dir: str = knob(WorkerConfig, "model_cache_dir")
    device: Device = knob(ModelPlacement, "device")
    dtype: Dtype = knob(ModelPlacement, "dtype")
    modulation_cache: ModulationCache = knob(PipelineSettings, "modulation_cache")
    max_sequence_length: int = knob(PipelineSettings, "max_sequence_length")
    quantization: Quantization = knob(PipelineSettings, "quantization")
    fp8_layers: Fp8Layers = knob(PipelineSettings, "fp8_layers")
    attention_backend: AttentionBackend = knob(PipelineSettings, "attention_backend")
    loras: list[LoraAdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters merged into the DiT weights at load, in this order (a LoRA form of "
        "a distilled model like Qwen-Image-Lightning too). The manifests' model_revision names the "
        "base, the adapters and their scales. A key that matches no layer is an error.",
    )
    scheduler_config: str | None = Field(
        default=None,
        description="A scheduler_config.json (or a folder holding one) replacing the checkpoint's "
        "scheduler/: the few-step schedule a distilled LoRA was trained with. null: the checkpoint's own "
        "(a merged distilled checkpoint ships its schedule there). s3://bucket/key or a local path every node sees.",
    )
    text_encoder: Placement = knob(ModelPlacement, "text_encoder")
    embedding_cache_mb: int = knob(ModelPlacement, "embedding_cache_mb")
    license: str | None = Field(
        default=None,
        description="The model's licence id as model cards write it (apache-2.0, "
        "flux-1-dev-non-commercial-license, ...), recorded in _job.json, every image's metadata and the "
        "manifests' model_license column. null: the one the model card names (README.md front matter "
        "`license:`, or `license_name:` under `license: other`); an hf:// model's card is not read to plan.",
    )
    require_commercial_licence: bool = Field(
        default=False,
        description="Refuse, before any work, a model whose licence is not known to permit commercial use "
        "(FLUX.1-dev, FLUX.2-dev and other non-commercial licences; an unknown licence too). The ids "
        "ditfleet knows: ditfleet/workers/weights/licence.py, KNOWN_LICENCES.",
    )

    _path_ok = field_validator("path")(_plain_s3_uri)
    _license_ok = field_validator("license")(lambda v: None if v is None else check_licence_id(v))
    _scheduler_ok = field_validator("scheduler_config")(lambda v: None if v is None else _node_file(v))


# Defaults for rows that give none (workers.rows.RowConfig), and how CFG runs.
class SamplingSpec(Section):
    steps: int = knob(RowConfig, "steps")
    true_cfg_scale: float = knob(RowConfig, "true_cfg_scale")
    negative_prompt: str | None = knob(RowConfig, "negative_prompt")
    seed: int = knob(RowConfig, "job_seed")
    num_images: int = knob(RowConfig, "num_images")
    max_prompt_chars: int = knob(RowConfig, "max_prompt_chars")
    cfg_mode: CfgMode = knob(PipelineSettings, "cfg_mode")
    # Parsed by its knob (model.cfg_table.parse_cfg_table): a CfgTable or None from here down.
    cfg_table: CfgTable | None = knob(PipelineSettings, "cfg_table")
    # Parsed by its knob (model.step_cache_config.parse_step_cache): a StepCacheConfig or None
    # from here down.
    step_cache: StepCacheConfig | None = knob(PipelineSettings, "step_cache")

    @model_validator(mode="after")
    def _step_cache_fits_schedule(self) -> SamplingSpec:
        check_schedule(self.step_cache, self.steps)
        return self


class BucketsSpec(Section):
    names: list[str] | None = Field(
        default=None,
        description="Resolution buckets 'WxH' (multiples of 16); the first is the default size. "
        "null: the model's own (tiny: 128x128, 160x96, 96x160; else Qwen-Image's recommended sizes).",
    )
    strict: bool = Field(
        default=False,
        description="true: a row size that is not a bucket is an input error; false: nearest aspect ratio.",
    )

    @field_validator("names")
    @classmethod
    def _parse(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else list(BucketSet.from_names(names).names)  # BucketError: a ValueError


# torch.compile at actor start-up (compile.config.CompileConfig), and where each actor finds the
# key of the shared compile cache (workers.cache_secret.CacheSecretSource).
class CompileSpec(Section):
    vae: OnOffAuto = knob(CompileConfig, "vae")
    dit: OnOffAuto = knob(CompileConfig, "dit")
    shared_cache: bool = knob(CompileConfig, "shared_cache")
    claim_timeout_s: float = knob(CompileConfig, "claim_timeout_s")
    cache_key_env: str | None = knob(CacheSecretSource, "env")
    cache_key_file: str | None = knob(CacheSecretSource, "file")

    @field_validator("cache_key_file")
    @classmethod
    def _absolute_key_file(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isabs(path):
            raise ValueError(
                "cache_key_file must be an absolute path on the actors' nodes (a mounted secret, "
                "e.g. /etc/ditfleet/compile-cache-key)"
            )
        return path

    @field_validator("cache_key_env")
    @classmethod
    def _secret_key_env(cls, name: str | None) -> str | None:
        if name is not None and name in WELL_KNOWN_ENV:
            raise ValueError(
                f"cache_key_env: ${name} is a well-known variable, its value is no secret; name a variable "
                "that holds only the key, or better, mount the key as a file (cache_key_file, mode 0600)"
            )
        return name


# The actor fleet: dispatch's knobs (driver.dispatch.DispatchConfig) and the batch size
# (workers.contract.WorkerConfig); `max` and `gpus` resolve against other sections in JobSpec.
class WorkersSpec(Section):
    min: int = knob(DispatchConfig, "min_actors")
    max: int | None = Field(
        default=None,
        ge=1,
        description="Actors grown to while shards wait (pending ones ask the autoscaler); null: min.",
    )
    gpus: float | None = Field(
        default=None,
        ge=0,
        description="GPUs per actor; null: 0 for the tiny model, 1 otherwise. A share below 1 "
        "is refused unless model.device is cpu (each actor plans for and loads onto a whole card).",
    )
    cpus: float = knob(DispatchConfig, "num_cpus")
    batch_size: int = knob(WorkerConfig, "batch_size")
    gpu_memory_gb: float | None = Field(
        default=None,
        gt=0,
        description="Memory of each actor's GPU in GB as the card is sold (80, 48, 24, ...): plan and "
        "validate refuse a batch size that cannot fit it and name the largest that does; null: no check.",
    )
    shards_in_flight: int = knob(DispatchConfig, "shards_in_flight_per_actor")
    speculative_tail: bool = knob(DispatchConfig, "speculative_tail")
    idle_retire_s: float = knob(DispatchConfig, "idle_retire_s")
    placement_timeout_s: float | None = knob(DispatchConfig, "placement_timeout_s")

    @model_validator(mode="after")
    def _max_at_least_min(self) -> WorkersSpec:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


# Image scores taken where each image is made (workers.contract.WorkerConfig.scorers), and the
# gate that makes an image again when it scores too low (workers.contract.GateConfig).
class GateSpec(Section):
    scorer: ScorerName = knob(GateConfig, "scorer")
    min: float = knob(GateConfig, "min")
    max_tries: int = knob(GateConfig, "max_tries")


class QualitySpec(Section):
    scorers: tuple[ScorerName, ...] = knob(WorkerConfig, "scorers")
    clip_model: str | None = knob(WorkerConfig, "clip_model")
    gate: GateSpec | None = Field(
        default=None,
        description="Make an image again, with the next seed of a fixed sequence, while it scores "
        "under `min` (at most `max_tries` tries; the row keeps its best). The gate's scorer is "
        "taken whether or not `scorers` lists it. Null: every image is kept as first made.",
    )


# Units of work (driver.plan.PlanConfig) and how often one is retried (DispatchConfig).
class ShardsSpec(Section):
    size: int = knob(PlanConfig, "shard_size")
    max_attempts: int = knob(DispatchConfig, "max_attempts")


# What an image costs, in the summary, the report and `ditfleet plan` (driver.output.cost).
class CostSpec(Section):
    gpu_hour_usd: float | None = knob(CostConfig, "gpu_hour_usd")


# Client settings for s3:// input and output: the store's own knobs (workers.storage.S3Config).
class S3Spec(Section):
    endpoint_url: str | None = knob(S3Config, "endpoint_url")
    region: str | None = knob(S3Config, "region")
    max_attempts: int = knob(S3Config, "max_attempts")
    addressing_style: AddressingStyle = knob(S3Config, "addressing_style")
    single_writer: bool = knob(S3Config, "single_writer")
