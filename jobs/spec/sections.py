"""The sections of a job file (input, output, model, sampling, buckets, compile, workers, shards,
s3): one pydantic model each, every field saying why it exists.

Unknown keys are errors (`extra="forbid"`): a typo in a job file must not be silently ignored.
Fields are checked here, one section at a time; what spans sections is checked by `JobSpec`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ditfleet.compile.buckets import BucketError, BucketSet, ResolutionBucket
from ditfleet.model.guidance import DEFAULT_NEGATIVE_PROMPT
from ditfleet.workers.cache_secret import WELL_KNOWN_ENV
from ditfleet.workers.output.layout import FORMAT_NAMES, IMAGE_EXTENSIONS
from ditfleet.workers.rows import CFG_RANGE, MAX_SEED, NUM_IMAGES_RANGE, STEPS_RANGE
from ditfleet.workers.storage.input_files import check_s3_uri

IMAGE_FORMATS = tuple(IMAGE_EXTENSIONS)  # png, webp, jpeg

TINY_MODEL = "tiny"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
        1.0,
        ge=-8.0,
        le=8.0,
        description="Strength of the adapter: its update is multiplied by this (diffusers' adapter weight).",
    )

    _path_ok = field_validator("path")(_node_file)


class InputSpec(Section):
    path: str = Field(
        description="The prompt Parquet: a file, a directory of *.parquet files, or a glob "
        "('prompts/**/*.parquet'); local or s3://bucket/key. Relative paths start at the current directory."
    )
    incremental: bool = Field(
        False,
        description="The input grows (a new file lands every night): each run generates only the rows "
        "the output does not have yet, keyed by id (rows without an id column by file name and row), "
        "and adds shards next to the earlier ones. Off: the output belongs to exactly the files it was "
        "started with, and a grown input is refused. Ids of rows without an id column differ between "
        "the two modes, so the mode of an output cannot change.",
    )

    _path_ok = field_validator("path")(_plain_s3_uri)


class OutputSpec(Section):
    uri: str = Field(
        description="Where images, manifests, _job.json and _SUCCESS go: a local directory or "
        "s3://bucket/prefix. Running again with the same output resumes the job."
    )
    format: Literal[FORMAT_NAMES] = Field(
        "files",
        description="'files': one image object per image; 'parquet': images embedded in one Parquet "
        "file per shard (Hugging Face datasets image struct); 'webdataset': one tar per shard "
        "({key}.{ext} + {key}.json).",
    )
    image_format: Literal[IMAGE_FORMATS] = Field(
        "png", description="Image encoding: png (lossless), webp or jpeg (smaller, lossy)."
    )
    quality: int | None = Field(
        None, ge=1, le=100, description="webp/jpeg quality 1..100; null: the codec's default. Not for png."
    )

    shared_filesystem: bool = Field(
        False,
        description="A local output path is on a filesystem every node mounts at the same place (NFS, "
        "EFS, Lustre). Without it a local output is refused on a cluster of more than one node: each "
        "node would write to its own disk.",
    )

    _uri_ok = field_validator("uri")(_plain_s3_uri)

    @model_validator(mode="after")
    def _quality_needs_lossy(self) -> OutputSpec:
        if self.quality is not None and self.image_format == "png":
            raise ValueError("quality applies to webp and jpeg only; drop it or choose another image_format")
        return self


class ModelSpec(Section):
    path: str = Field(
        TINY_MODEL,
        description="'tiny' (the bundled small model), a local directory in the diffusers layout, "
        "s3://bucket/prefix (that layout in a bucket) or hf://org/name@revision (needs the 'hub' extra).",
    )
    cache_dir: str = Field(
        "/tmp/ditfleet/models",
        description="Node-local directory where remote weights are fetched once per node and shared by "
        "every actor on it. Needs room for the model (about 58 GB for Qwen-Image with its text encoder).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when the actor has a GPU.")
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on cuda, fp32 on cpu.")
    modulation_cache: Literal["off", "cfg", "table"] = Field(
        "cfg",
        description="Reuse block modulations: 'cfg' computes them once per step for both CFG passes, "
        "'table' once per bucket schedule per actor (more memory). Outputs are identical.",
    )
    max_sequence_length: int = Field(512, ge=1, le=1024, description="Longest prompt, in text tokens.")
    loras: list[LoraAdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters merged into the DiT weights at load, in this order (a LoRA form of "
        "a distilled model like Qwen-Image-Lightning too). The manifests' model_revision names the "
        "base, the adapters and their scales. A key that matches no layer is an error.",
    )
    scheduler_config: str | None = Field(
        None,
        description="A scheduler_config.json (or a folder holding one) replacing the checkpoint's "
        "scheduler/: the few-step schedule a distilled LoRA was trained with. null: the checkpoint's own "
        "(a merged distilled checkpoint ships its schedule there). s3://bucket/key or a local path every node sees.",
    )
    text_encoder: Literal["gpu", "cpu", "offload"] = Field(
        "gpu",
        description="Where the text encoder lives: 'gpu' (always next to the DiT), 'cpu' (encodes on the "
        "CPU; its weights never take GPU memory), 'offload' (comes onto the GPU to encode a shard's prompts "
        "up front, then leaves; the DiT waits in host memory meanwhile when both do not fit). "
        "`ditfleet plan` shows what each needs.",
    )
    embedding_cache_mb: int = Field(
        256,
        ge=0,
        le=1 << 20,
        description="Prompt embeddings kept per actor (least recently used dropped first), so the job's "
        "negative prompt and repeated prompts are encoded once; 0: keep none.",
    )

    _path_ok = field_validator("path")(_plain_s3_uri)
    _scheduler_ok = field_validator("scheduler_config")(lambda v: None if v is None else _node_file(v))


class SamplingSpec(Section):
    steps: int = Field(
        50, ge=STEPS_RANGE[0], le=STEPS_RANGE[1], description="Denoising steps (a row's `steps` wins)."
    )
    true_cfg_scale: float = Field(
        4.0,
        ge=CFG_RANGE[0],
        le=CFG_RANGE[1],
        description="True CFG scale; > 1 with a negative prompt turns CFG on.",
    )
    negative_prompt: str | None = Field(
        DEFAULT_NEGATIVE_PROMPT, description="Default negative prompt; null: none (CFG off)."
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="Job seed: a row without `seed` gets one derived from this and its id.",
    )
    num_images: int = Field(
        1,
        ge=NUM_IMAGES_RANGE[0],
        le=NUM_IMAGES_RANGE[1],
        description="Images per row (a row's `num_images` wins).",
    )
    max_prompt_chars: int = Field(4000, ge=1, le=10**7, description="Longer prompts are input errors.")
    cfg_mode: Literal["serial", "batched", "auto"] = Field(
        "auto",
        description="How the two true-CFG passes of a step run: 'serial' (two forwards of the batch; "
        "the modulation cache computes the step's modulation once), 'batched' (one forward of twice "
        "the batch, text padded to the longer branch), 'auto' (batched on a GPU while a pass is too "
        "small to fill it and batching pads little, else serial).",
    )


class BucketsSpec(Section):
    names: list[str] | None = Field(
        None,
        description="Resolution buckets 'WxH' (multiples of 16); the first is the default size. "
        "null: the model's own (tiny: 128x128, 160x96, 96x160; else Qwen-Image's recommended sizes).",
    )
    strict: bool = Field(
        False,
        description="true: a row size that is not a bucket is an input error; false: nearest aspect ratio.",
    )

    @field_validator("names")
    @classmethod
    def _parse(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        try:
            return [ResolutionBucket.parse(n).name for n in BucketSet.from_names(names).names]
        except BucketError as e:
            raise ValueError(str(e)) from e


class CompileSpec(Section):
    vae: bool = Field(True, description="Compile the VAE decode, warmed once per bucket at actor start-up.")
    dit: bool | Literal["auto"] = Field(
        False,
        description="Compile the DiT blocks too: one graph pair per resolution bucket (batch size and "
        "prompt length are dynamic), longer start-up, faster steps on GPUs. 'auto': on for CUDA "
        "actors expected to make enough images per bucket to repay the warm-up.",
    )
    shared_cache: bool = Field(
        True,
        description="Share compiled artifacts through the output store, so new actors start faster. "
        "Only blobs authenticated with the fleet's secret key are loaded (they hold executable code); "
        "without a key on the actor's node the shared cache is off.",
    )
    claim_timeout_s: float = Field(
        600.0,
        ge=0,
        description="Actors on one machine claim each bucket before compiling it, so a bucket compiles "
        "once per machine and the others load it from the local compile cache; a waiter compiles the "
        "bucket itself after this many seconds (a dead claimant frees it at once). 0: every actor "
        "compiles every bucket.",
    )
    cache_key_env: str | None = Field(
        "DITFLEET_COMPILE_CACHE_KEY",
        description="Environment variable, on every actor's node, holding the secret key (at least 16 "
        "bytes, e.g. `openssl rand -hex 32`) that authenticates shared compile artifacts. Never put "
        "the key itself in the job file or the bucket.",
    )
    cache_key_file: str | None = Field(
        None,
        description="Absolute path, on every actor's node, of a file holding that key (a mounted "
        "secret); wins over cache_key_env.",
    )

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


class WorkersSpec(Section):
    min: int = Field(1, ge=1, description="Actors started at once and kept while shards wait.")
    max: int | None = Field(
        None,
        ge=1,
        description="Actors grown to while shards wait (pending ones ask the autoscaler); null: min.",
    )
    gpus: float | None = Field(
        None, ge=0, description="GPUs per actor; null: 0 for the tiny model, 1 otherwise."
    )
    cpus: float = Field(1.0, ge=0, description="CPUs per actor (encode/upload threads run on them).")
    batch_size: int = Field(
        4, ge=1, le=1024, description="Images generated together (same bucket and steps)."
    )
    gpu_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of each actor's GPU in GB as the card is sold (80, 48, 24, ...): plan and "
        "validate refuse a batch size that cannot fit it and name the largest that does; null: no check.",
    )
    shards_in_flight: int = Field(
        2, ge=1, le=8, description="Shards queued per actor, so its GPU never waits."
    )
    speculative_tail: bool = Field(
        True, description="Near the end, rerun slow shards on idle actors; the first commit wins."
    )
    idle_retire_s: float = Field(
        10.0, ge=0, description="Stop an actor idle this long once nothing is queued."
    )
    placement_timeout_s: float | None = Field(
        1800.0, gt=0, description="Give up when no actor can be placed for this long; null: wait forever."
    )

    @model_validator(mode="after")
    def _max_at_least_min(self) -> WorkersSpec:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


class ShardsSpec(Section):
    size: int = Field(256, ge=1, description="Input rows per shard: the unit of work, retry and commit.")
    max_attempts: int = Field(
        3, ge=1, le=100, description="Failed runs of a shard before it is reported failed."
    )


class S3Spec(Section):
    endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint (MinIO, R2, ...); null: AWS. Credentials come from the AWS chain.",
    )
    region: str | None = Field(None, description="Region of the bucket(s); null: the AWS default.")
    max_attempts: int = Field(
        10, ge=1, le=100, description="Attempts per S3 request (botocore standard retries)."
    )
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="'path' for most S3-compatible servers (bucket in the path, not the host name)."
    )
    single_writer: bool = Field(
        False,
        description="Allow an output store without conditional writes (it answers 501 to "
        "If-None-Match), which is refused otherwise: commits then check and write in two steps, "
        "safe only while one driver at a time writes the output and no shard runs twice at once "
        "(needs workers.speculative_tail: false).",
    )
