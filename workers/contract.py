"""The driver-worker contract: what an actor is given and what it returns, without torch.

The job spec builds a `WorkerConfig`, the driver hands it to each actor and reads `ShardResult`s
and `ShardAbandoned` back; none of them needs the model, so the driver, `ditfleet validate` and
`ditfleet plan` import this module instead of `workers.actor` (which loads torch and the model).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ditfleet.compile.config import CompileConfig
from ditfleet.model.knobs import check_settings, setting
from ditfleet.model.loading.lora_spec import LoraSpec  # noqa: F401 - re-exported for the job spec
from ditfleet.model.quality.table import MODEL, SCORERS, ScorerName, needing
from ditfleet.model.settings import PipelineSettings
from ditfleet.workers.cache_secret import CacheSecretSource
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.fetch_config import FetchConfig

# Where the text encoder lives (workers.text_embeddings places it).
Placement = Literal["gpu", "cpu", "offload"]
Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "bf16", "fp32"]
PLACEMENTS: tuple[str, ...] = typing.get_args(Placement)

# The node-local folder where remote weights are fetched once per node, unless the job names another.
MODEL_CACHE_DIR = "/tmp/ditfleet/models"


@dataclass(frozen=True)
class ModelPlacement:
    """Where an actor puts the model: its device and dtype, and the text encoder's place."""

    device: Device = setting("auto", fingerprint="always", description="auto: cuda when the actor has a GPU.")
    dtype: Dtype = setting("auto", fingerprint="always", description="auto: bf16 on cuda, fp32 on cpu.")
    text_encoder: Placement = setting(
        "gpu",
        description="Where the text encoder lives: 'gpu' (always next to the DiT), 'cpu' (encodes on the "
        "CPU; its weights never take GPU memory), 'offload' (comes onto the GPU to encode a shard's prompts "
        "up front, then leaves; the DiT waits in host memory meanwhile when both do not fit). "
        "`ditfleet plan` shows what each needs.",
    )
    embedding_cache_mb: int = setting(
        256,
        ge=0,
        le=1 << 20,
        description="Prompt embeddings kept per actor (least recently used dropped first), so the job's "
        "negative prompt and repeated prompts are encoded once; 0: keep none.",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def embedding_cache_bytes(self) -> int:
        return self.embedding_cache_mb * 2**20


@dataclass(frozen=True)
class GateConfig:
    """quality.gate: an image whose score is under `min` is made again with the next seed of its
    fixed sequence (workers.generate.try_seed), up to `max_tries` in all; the row keeps its best
    try and records every try's score and seed. An image the scorer cannot judge is kept as made."""

    scorer: ScorerName = setting(
        "tiny", description="The scorer that decides (one of quality.scorers' names)."
    )
    min: float = setting(
        1.0,
        description="The lowest passing score: an image scoring under it is made again (higher is better).",
    )
    max_tries: int = setting(
        3,
        ge=1,
        le=16,
        description="Tries per image at most, the first included; each is one more image's work.",
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class WorkerConfig:
    """What one worker needs; built by jobs/ from the job spec."""

    output_uri: str
    rows: RowConfig = field(default_factory=RowConfig)
    model_path: str = (
        "tiny"  # a local diffusers-layout folder, "tiny", s3://bucket/prefix or hf://org/name@rev
    )
    model_cache_dir: str = setting(
        MODEL_CACHE_DIR,
        description="Node-local directory where remote weights are fetched once per node and shared by "
        "every actor on it. Needs room for the model (about 58 GB for Qwen-Image with its text encoder).",
    )
    model_fetch: FetchConfig = field(default_factory=FetchConfig)
    placement: ModelPlacement = field(default_factory=ModelPlacement)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)  # handed to load_pipeline
    loras: tuple[LoraSpec, ...] = ()  # adapters merged into the DiT at load, in order (local or s3://)
    scheduler_config: str | None = None  # replaces the checkpoint's scheduler (a distilled LoRA's)
    # In the fingerprint: batched kernels round differently for other batch shapes, so an image
    # can differ in a few pixel values between batch sizes (measured on CPU, fp32).
    batch_size: int = setting(
        4,
        ge=1,
        le=1024,
        fingerprint="always",
        description="Images generated together (same bucket and steps).",
    )
    scorers: tuple[ScorerName, ...] = setting(
        (),
        description="Image scorers run on each image right after it is made, each filling its manifest "
        "column score_{name}: "
        + ", ".join(f"'{row.name}' ({row.doc})" for row in SCORERS)
        + ". For an existing output: `ditfleet score`.",
    )
    clip_model: str | None = setting(
        None,
        description="The CLIP model of the 'clip' scorer: a local folder holding a transformers CLIPModel "
        "(config, weights, tokenizer and preprocessor files), s3://bucket/prefix holding one (fetched once "
        "per node like the model), or hf://org/name[@revision]. Needed when 'clip' scores.",
    )
    gate: GateConfig | None = None  # quality.gate; None: every image is kept as first made
    warmup_buckets: tuple[str, ...] = ()  # the buckets this job uses; empty = every job bucket
    # An edit job's heaviest row's sources per bucket, (width, height) each as read, from the
    # plan (driver.plan.JobPlan.sources_per_bucket): what the actor's batch fit counts.
    bucket_sources: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict, hash=False)
    expected_images: int | None = None  # images one actor is expected to make (compile.dit "auto")
    compile: CompileConfig = field(default_factory=CompileConfig)
    # A local output that is not on a shared filesystem: the Ray node id of the driver, the one
    # node whose disk it is. An actor on any other node refuses to start (it would write to its
    # own disk). None: an s3:// output, or a filesystem every node shares.
    local_output_node: str | None = None
    # The identity of the model's bytes the plan recorded (workers.weights.digest.ModelIdentity
    # as a dict), set by the driver: an actor whose copy differs refuses to start, so it can never
    # commit images of other weights. None: not recorded (hf:// models, or an old driver).
    model_identity: dict | None = None
    # Where each actor finds the key that authenticates the shared compile cache (not the key).
    compile_cache_key: CacheSecretSource = field(default_factory=CacheSecretSource)
    writer: ShardWriterConfig = field(default_factory=ShardWriterConfig)
    job_name: str | None = None  # the job spec's name: each image's metadata names it
    # The model's licence id as the driver resolved it (workers.weights.licence): each image's
    # metadata and manifest row name it. None: not known.
    model_license: str | None = None
    s3: S3Config = field(default_factory=S3Config)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def scorer_names(self) -> tuple[ScorerName, ...]:
        """The scorers an actor runs: quality.scorers, and the gate's scorer whether or not they
        list it."""
        return tuple(dict.fromkeys((*self.scorers, *((self.gate.scorer,) if self.gate else ()))))

    def scorer_models(self) -> dict[str, str | None]:
        """The model source each scorer that needs a model of its own names (its row's setting:
        `clip` -> clip_model), by scorer name; None where the job gives none."""
        return {row.name: getattr(self, row.setting or "") for row in needing(self.scorer_names, MODEL)}


@dataclass
class ShardResult:
    shard: int
    attempt: int
    status: str  # committed | already_committed
    rows: int = 0
    images_ok: int = 0
    images_failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    generate_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0
    wall_s: float = 0.0
    worker_id: str = ""
    recompiles: int = 0
    # Batches halved after a CUDA out-of-memory error and run again (workers.generate). Their
    # images differ at rounding level from an unsplit run's: a lower batch_size avoids them.
    oom_splits: int = 0
    # DiT attention over this shard (model.qwen_image.attention.AttentionStats): calls, masked_calls (a
    # dense mask), split_calls (padded, run unmasked per text length), image/text/padded tokens.
    attention: dict[str, int] = field(default_factory=dict)
    attempt_token: str = ""  # the key component of this run's objects (layout.new_attempt_token)
    # Images per batch this actor ran with: workers.batch_size, or less where its GPU fits less
    # (workers.batch_fit); 0 from an older actor.
    batch_size: int = 0
    # Whether the shard's rows (and per-shard inputs) were prepared ahead, while the shard before
    # it ran (workers.prefetch), and how long the run waited for them (all of the reading when
    # not prefetched, what was left of it when the prefetch was still under way).
    prefetched: bool = False
    input_wait_s: float = 0.0


class ShardAbandoned(RuntimeError):
    """The worker was asked to stop (spot reclaim); nothing of the shard was committed."""
