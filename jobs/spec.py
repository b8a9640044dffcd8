"""The job spec: one YAML (or JSON) file that says what to generate, where, and how.

    spec = load_spec("job.yaml")          # SpecError naming the file, line and key on any problem
    run_job(spec.to_driver_config(), spec.to_worker_config())

Sections map onto the lower layers' configs; each field says why it exists. Unknown keys are
errors (`extra="forbid"`): a typo in a job file must not be silently ignored. Relative local
paths are resolved against the current directory when the spec is converted, so every actor
gets the same absolute path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compile.buckets import QWEN_IMAGE_BUCKETS, TINY_BUCKETS, BucketError, BucketSet, ResolutionBucket
from compile.config import CompileConfig
from driver.dispatch import DispatchConfig
from driver.memory_plan import MemoryRequest
from driver.plan import PlanConfig
from driver.run_job import DriverConfig
from model.guidance import DEFAULT_NEGATIVE_PROMPT
from workers.cache_secret import CacheSecretSource
from workers.contract import LoraSpec, WorkerConfig
from workers.output.formats import ShardWriterConfig
from workers.rows import CFG_RANGE, MAX_SEED, NUM_IMAGES_RANGE, STEPS_RANGE, RowConfig
from workers.storage import S3Config
from workers.storage.input_files import check_s3_uri

TINY_MODEL = "tiny"


class SpecError(ValueError):
    """A job file that cannot be used; the message names the file, line and key."""


class _Section(BaseModel):
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


class LoraAdapterSpec(_Section):
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


class InputSpec(_Section):
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


class OutputSpec(_Section):
    uri: str = Field(
        description="Where images, manifests, _job.json and _SUCCESS go: a local directory or "
        "s3://bucket/prefix. Running again with the same output resumes the job."
    )
    format: Literal["files", "parquet", "webdataset"] = Field(
        "files",
        description="'files': one image object per image; 'parquet': images embedded in one Parquet "
        "file per shard (Hugging Face datasets image struct); 'webdataset': one tar per shard "
        "({key}.{ext} + {key}.json).",
    )
    image_format: Literal["png", "webp", "jpeg"] = Field(
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


class ModelSpec(_Section):
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


class SamplingSpec(_Section):
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


class BucketsSpec(_Section):
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


class CompileSpec(_Section):
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


class WorkersSpec(_Section):
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


class ShardsSpec(_Section):
    size: int = Field(256, ge=1, description="Input rows per shard: the unit of work, retry and commit.")
    max_attempts: int = Field(
        3, ge=1, le=100, description="Failed runs of a shard before it is reported failed."
    )


class S3Spec(_Section):
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


class JobSpec(_Section):
    """A ditfleet job: what to generate (input), where (output), with what (model, sampling)."""

    name: str | None = Field(None, description="A name for logs and summaries.")
    input: InputSpec = Field(description="The prompts.")
    output: OutputSpec = Field(description="Where results go.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model and its numerics.")
    sampling: SamplingSpec = Field(
        default_factory=SamplingSpec, description="Defaults for rows that give none."
    )
    buckets: BucketsSpec = Field(default_factory=BucketsSpec, description="Image sizes.")
    compile: CompileSpec = Field(default_factory=CompileSpec, description="torch.compile at actor start-up.")
    workers: WorkersSpec = Field(default_factory=WorkersSpec, description="The actor fleet.")
    shards: ShardsSpec = Field(default_factory=ShardsSpec, description="Units of work.")
    s3: S3Spec = Field(default_factory=S3Spec, description="Client settings for s3:// input and output.")

    @model_validator(mode="after")
    def _single_writer_needs_no_twins(self) -> JobSpec:
        if self.s3.single_writer and self.workers.speculative_tail:
            raise ValueError(
                "s3.single_writer: true needs workers.speculative_tail: false (a speculative twin is "
                "a second writer of the same shard, which such a store cannot keep apart)"
            )
        return self

    # -- resolution ------------------------------------------------------------------------------

    def bucket_names(self) -> list[str]:
        if self.buckets.names is not None:
            return list(self.buckets.names)
        default = TINY_BUCKETS if self.model.path == TINY_MODEL else QWEN_IMAGE_BUCKETS
        return [b.name for b in default]

    def gpus_per_actor(self) -> float:
        if self.workers.gpus is not None:
            return self.workers.gpus
        return 0.0 if self.model.path == TINY_MODEL else 1.0

    def input_uri(self) -> str:
        return _absolute(self.input.path)

    def output_uri(self) -> str:
        return _absolute(self.output.uri)

    def model_cache_dir(self) -> str:
        """`~` expanded and made absolute: every actor fetches weights to the same place."""
        return _absolute(self.model.cache_dir)

    def model_path(self) -> str:
        return self.model.path if self.model.path == TINY_MODEL else _absolute(self.model.path)

    def model_loras(self) -> tuple[LoraSpec, ...]:
        return tuple(LoraSpec(_absolute(a.path), a.scale) for a in self.model.loras)

    def model_scheduler_config(self) -> str | None:
        return _absolute(self.model.scheduler_config) if self.model.scheduler_config else None

    def resolved(self) -> dict[str, Any]:
        """The spec with every default and path filled in (JSON-safe): what `_job.json` stores."""
        doc = self.model_dump(mode="json")
        doc["input"]["path"] = self.input_uri()
        doc["output"]["uri"] = self.output_uri()
        doc["model"]["path"] = self.model_path()
        doc["model"]["cache_dir"] = self.model_cache_dir()
        doc["model"]["loras"] = [{"path": a.path, "scale": a.scale} for a in self.model_loras()]
        doc["model"]["scheduler_config"] = self.model_scheduler_config()
        doc["buckets"]["names"] = self.bucket_names()
        doc["workers"]["max"] = self.workers.max or self.workers.min
        doc["workers"]["gpus"] = self.gpus_per_actor()
        return doc

    def row_config(self) -> RowConfig:
        s = self.sampling
        return RowConfig(
            job_seed=s.seed,
            buckets=BucketSet.from_names(self.bucket_names(), strict=self.buckets.strict),
            steps=s.steps,
            true_cfg_scale=s.true_cfg_scale,
            negative_prompt=s.negative_prompt,
            num_images=s.num_images,
            max_prompt_chars=s.max_prompt_chars,
        )

    def image_settings(self) -> dict[str, Any]:
        """Settings that change the stored bytes of an image, for the plan's fingerprint.
        The batch size is one: batched kernels round differently for different batch shapes, so
        an image can differ in a few pixel values between batch sizes (measured on CPU, fp32).
        The modulation cache is not: outputs are identical with and without it.
        Adapters and a scheduler override are listed only when set, so outputs planned before
        they existed keep their fingerprint."""
        settings: dict[str, Any] = {
            "model": self.model_path(),
            "device": self.model.device,
            "dtype": self.model.dtype,
            "compile_vae": self.compile.vae,
            "compile_dit": self.compile.dit,
            "cfg_mode": self.sampling.cfg_mode,
            "max_sequence_length": self.model.max_sequence_length,
            "batch_size": self.workers.batch_size,
            "output_format": self.output.format,
            "image_format": self.output.image_format,
            "quality": self.output.quality,
        }
        if self.model.loras:
            settings["loras"] = [{"path": a.path, "scale": a.scale} for a in self.model_loras()]
        if self.model.scheduler_config:
            settings["scheduler_config"] = self.model_scheduler_config()
        return settings

    def memory_request(self) -> MemoryRequest:
        """What one actor asks of its GPU, for the memory plan (every bucket of the job)."""
        table = self.model.modulation_cache == "table"
        on_cpu = self.model.device == "cpu" or self.gpus_per_actor() == 0
        return MemoryRequest(
            model_path=self.model_path(),
            buckets=tuple(self.bucket_names()),
            batch_size=self.workers.batch_size,
            # auto is bf16 on a GPU, fp32 on the CPU (an actor without a GPU)
            dtype="fp32" if self.model.dtype == "fp32" or (on_cpu and self.model.dtype == "auto") else "bf16",
            text_encoder=self.model.text_encoder,
            gpu_memory_gb=self.workers.gpu_memory_gb,
            cfg="serial",  # rows may turn CFG on whatever the default; serial passes hold one output more
            vae_batch=1 if self.compile.vae else None,
            max_sequence_length=self.model.max_sequence_length,
            table_steps=(self.sampling.steps,) if table else (),
            s3=self.s3_config(),
            device="cpu" if on_cpu else "cuda",
        )

    def s3_config(self) -> S3Config:
        return S3Config(
            endpoint_url=self.s3.endpoint_url,
            region=self.s3.region,
            max_attempts=self.s3.max_attempts,
            addressing_style=self.s3.addressing_style,
            single_writer=self.s3.single_writer,
        )

    def to_driver_config(self) -> DriverConfig:
        w = self.workers
        return DriverConfig(
            input_uri=self.input_uri(),
            output_uri=self.output_uri(),
            plan=PlanConfig(
                rows=self.row_config(), shard_size=self.shards.size, image_settings=self.image_settings()
            ),
            dispatch=DispatchConfig(
                min_actors=w.min,
                max_actors=w.max or w.min,
                num_gpus=self.gpus_per_actor(),
                num_cpus=w.cpus,
                shards_in_flight_per_actor=w.shards_in_flight,
                max_attempts=self.shards.max_attempts,
                speculative_tail=w.speculative_tail,
                idle_retire_s=w.idle_retire_s,
                placement_timeout_s=w.placement_timeout_s,
            ),
            s3=self.s3_config(),
            resolved_spec=json.dumps(self.resolved(), sort_keys=True),
            incremental=self.input.incremental,
            shared_filesystem=self.output.shared_filesystem,
        )

    def to_worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            output_uri=self.output_uri(),
            rows=self.row_config(),
            model_path=self.model_path(),
            model_cache_dir=self.model_cache_dir(),
            device=self.model.device,
            dtype=self.model.dtype,
            modulation_cache=self.model.modulation_cache,
            loras=self.model_loras(),
            scheduler_config=self.model_scheduler_config(),
            cfg_mode=self.sampling.cfg_mode,
            batch_size=self.workers.batch_size,
            max_sequence_length=self.model.max_sequence_length,
            text_encoder=self.model.text_encoder,
            embedding_cache_bytes=self.model.embedding_cache_mb * 2**20,
            compile=CompileConfig(
                vae=self.compile.vae,
                dit=self.compile.dit,
                shared_cache=self.compile.shared_cache,
                claim_timeout_s=self.compile.claim_timeout_s,
            ),
            compile_cache_key=CacheSecretSource(
                env=self.compile.cache_key_env, file=self.compile.cache_key_file
            ),
            writer=ShardWriterConfig(
                output_format=self.output.format,
                image_format=self.output.image_format,
                quality=self.output.quality,
            ),
            s3=self.s3_config(),
        )


def _absolute(path: str) -> str:
    """s3:// and file:// URIs as given; a local path made absolute (against the current dir)."""
    if "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


# -- loading ----------------------------------------------------------------------------------------


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file (YAML, or JSON for *.json). Raises SpecError listing every
    problem as 'file:line: key.path: what is wrong'."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{name}: job file not found; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{name}: cannot read the job file ({e})") from e
    return parse_spec(text, name)


def parse_spec(text: str, name: str = "<job>") -> JobSpec:
    """Validate job text; `name` is the file name used in error messages."""
    try:
        data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{name}:{e.lineno}: not valid JSON: {e.msg}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{name}{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from e
    if not isinstance(data, dict):
        raise SpecError(
            f"{name}: a job file must be a mapping with at least 'input' and 'output' sections, "
            f"got {type(data).__name__}"
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        lines = _key_lines(text)
        problems = [_describe(err, name, lines) for err in e.errors()]
        head = f"{name}: {len(problems)} problem{'s' if len(problems) != 1 else ''} in the job file:"
        raise SpecError("\n".join([head, *(f"  {p}" for p in problems)])) from None


def _describe(err: dict[str, Any], name: str, lines: dict[tuple[str, ...], int]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc) or "(top level)"
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    where = f"{name}:{line}" if line else name
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(loc[:-1]))
        return f"{where}: {key}: unknown key; allowed here: {allowed}"
    if kind == "missing":
        return f"{where}: {key}: required, missing"
    message = str(err["msg"]).removeprefix("Value error, ")
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"{where}: {key}: {message}{shown}"


def _allowed_keys(loc: tuple[str, ...]) -> list[str]:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every mapping key path in a YAML (or JSON) document, for error messages."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    out: dict[tuple[str, ...], int] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = (*prefix, str(key.value))
                out[path] = key.start_mark.line + 1
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out[(*prefix, str(i))] = item.start_mark.line + 1
                walk(item, (*prefix, str(i)))

    walk(root, ())
    return out
