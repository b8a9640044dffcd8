"""`JobSpec` gathers the sections (jobs.spec.sections) and maps them onto the lower layers' configs.
Relative local paths are resolved against the current directory when the spec is converted, so
every actor gets the same absolute path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from ditfleet.compile.buckets import BucketSet, default_buckets
from ditfleet.compile.config import CompileConfig
from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.driver.memory_plan import MemoryRequest
from ditfleet.driver.output.cost import CostConfig
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig
from ditfleet.model.family import (
    Size,
    check_model_index,
    model_family,
    model_max_sources,
    model_task,
    remember_remote_index,
    resolve_model_dir,
)
from ditfleet.model.generation.guidance import planned_cfg
from ditfleet.model.loading.folder import WeightsError, text_encoder_kind
from ditfleet.model.quality.table import MODEL, PIPELINE_QWEN_VL, check_scorers_supported, needing
from ditfleet.model.settings import PipelineSettings, resolve_modulation_cache
from ditfleet.model.step_cache_config import check_schedule
from ditfleet.workers.cache_secret import CacheSecretSource
from ditfleet.workers.contract import GateConfig, LoraSpec, ModelPlacement, WorkerConfig
from ditfleet.workers.output.formats import ShardWriterConfig
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.sources import planned_sources, task_problem
from ditfleet.workers.storage import S3Config
from ditfleet.workers.weights.hub import read_hub_index
from ditfleet.workers.weights.licence import JOB_SOURCE, ModelLicence, read_model_licence
from ditfleet.workers.weights.node_cache import ModelFetchError

from .derive import fingerprint_entries, settings_from
from .problems import validated
from .sampling_defaults import SAMPLING_KEYS, SamplingDefaults, recognise, resolve
from .sections import (
    BucketsSpec,
    CompileSpec,
    CostSpec,
    InputSpec,
    ModelSpec,
    OutputSpec,
    QualitySpec,
    S3Spec,
    SamplingSpec,
    Section,
    ShardsSpec,
    WorkersSpec,
)


class JobSpec(Section):
    """A ditfleet job: what to generate (input), where (output), with what (model, sampling)."""

    name: str | None = Field(default=None, description="A name for logs and summaries.")
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
    quality: QualitySpec = Field(default_factory=QualitySpec, description="Image scores in the manifests.")
    s3: S3Spec = Field(default_factory=S3Spec, description="Client settings for s3:// input and output.")
    cost: CostSpec = Field(default_factory=CostSpec, description="The price the cost per image is given at.")

    @model_validator(mode="after")
    def _whole_gpus_for_a_gpu_model(self) -> JobSpec:
        gpus = self.workers.gpus
        if gpus is not None and 0 < gpus < 1 and self.model.device != "cpu":
            raise ValueError(
                f"workers.gpus: {gpus:g} is a share of a GPU, but each actor sizes its batch from the "
                "whole card's memory and loads a whole DiT onto it, so actors sharing a card would run it "
                "out of memory. Use workers.gpus: 1 (one actor per GPU), or model.device: cpu to run "
                "without one"
            )
        return self

    @model_validator(mode="after")
    def _single_writer_needs_no_twins(self) -> JobSpec:
        if self.s3.single_writer and self.workers.speculative_tail:
            raise ValueError(
                "s3.single_writer: true needs workers.speculative_tail: false (a speculative twin is "
                "a second writer of the same shard, which such a store cannot keep apart)"
            )
        return self

    @model_validator(mode="after")
    def _scorers_have_what_they_need(self) -> JobSpec:
        """Each scorer's row (model.quality.table) says what it needs: the model a setting names,
        or what the model family offers (a Qwen2.5-VL text encoder)."""
        names = self.scorer_names()
        for row in needing(names, MODEL):
            if not getattr(self.quality, row.setting or ""):
                raise ValueError(
                    f"quality: the '{row.name}' scorer (in quality.scorers or quality.gate.scorer) needs "
                    f"{row.setting_key}: a folder holding {row.model}, s3://bucket/prefix or "
                    "hf://org/name[@revision]"
                )
        if needing(names, PIPELINE_QWEN_VL):
            offers, said = self._scorer_inputs()
            check_scorers_supported(offers, names, said)
        return self

    @model_validator(mode="after")
    def _model_folder_runs_here(self) -> JobSpec:
        check_model_folder(self.model.path)
        if self.model.path.startswith("hf://"):
            # Its model_index.json read here (when it can be): its family and task are known.
            index, _ = check_hub_model(self.model.path, self.model_cache_dir())
            task = model_task(self.model.path, index) if index is not None else None
            if task is not None and (problem := task_problem(self.model.path, task, self.input.image_column)):
                raise ValueError(problem)
        check_model_task(self.model.path, self.input.image_column)
        return self

    def _scorer_inputs(self) -> tuple[frozenset[str], str]:
        """What the job's model offers the scorers, and what an error says of it: its family's
        offer, and for the bundled model or a local folder none unless its text encoder, read
        here, is a Qwen2.5-VL (a remote model's is checked when an actor builds the scorer: its
        configs are not fetched to validate a job)."""
        path, offers = self.model.path, model_family(self.model.path).scorer_inputs
        if "://" in path and not path.startswith("file://"):
            return offers, ""
        try:
            kind = text_encoder_kind(
                resolve_model_dir(_absolute(path.removeprefix("file://"), path)) / "text_encoder"
            )
        except WeightsError as e:
            kind = f"unreadable ({e})"
        said = f"model.path {path!r} has a {kind} text encoder"
        return (offers if kind == "qwen2.5-vl" else frozenset()), said

    def scorer_names(self) -> tuple[str, ...]:
        """quality.scorers and the gate's scorer (the actor runs both)."""
        gate = self.quality.gate
        return tuple(dict.fromkeys((*self.quality.scorers, *((gate.scorer,) if gate else ()))))

    def with_changes(self, **changes: Any) -> JobSpec:
        """A copy with `changes` made and validated again like a job file (a JobSpec is frozen).

            spec.with_changes(name="tiny-10", sampling={"steps": 10}, output={"uri": "out/tiny-10"})

        A section given as a mapping changes only the keys it names, deeper mappings likewise;
        any other value replaces the key. Raises SpecError naming the key, as load_spec does."""
        doc = _merged(self.model_dump(mode="python", exclude_unset=True), changes)
        return validated(JobSpec, doc, "with_changes", what="the changed job")

    # -- resolution ------------------------------------------------------------------------------

    def bucket_names(self) -> list[str]:
        if self.buckets.names is not None:
            return list(self.buckets.names)
        return list(default_buckets(self.model.path).names)

    def gpus_per_actor(self) -> float:
        if self.workers.gpus is not None:
            return self.workers.gpus
        return 0.0 if model_family(self.model.path).runs_on_cpu else 1.0

    def input_uri(self) -> str:
        return _absolute(self.input.path)

    def output_uri(self) -> str:
        return _absolute(self.output.uri)

    def model_cache_dir(self) -> str:
        """`~` expanded and made absolute: every actor fetches weights to the same place."""
        return _absolute(self.model.cache_dir)

    def model_path(self) -> str:
        return _absolute(self.model.path, self.model.path)

    def model_loras(self) -> tuple[LoraSpec, ...]:
        return tuple(LoraSpec(_absolute(a.path), a.scale) for a in self.model.loras)

    def model_scheduler_config(self) -> str | None:
        """The scheduler replacing the checkpoint's: model.scheduler_config, else a recognised
        LoRA's published one (sampling_defaults); None: the checkpoint's own."""
        return self.sampling_defaults.scheduler_config

    @cached_property
    def sampling_defaults(self) -> SamplingDefaults:
        """steps, true_cfg_scale and negative_prompt for rows that give none, each with where it
        came from: the job's sampling section where it sets them, else the recognised checkpoint's
        published schedule (model/qwen_image/published/schedules.py), else ditfleet's defaults."""
        given_scheduler = _absolute(self.model.scheduler_config) if self.model.scheduler_config else None
        loras = tuple(a.path for a in self.model_loras())
        found, notes = recognise(self.model_path(), loras, given_scheduler, self.s3_config())
        if self.model.path.startswith("hf://") and (
            why := check_hub_model(self.model.path, self.model_cache_dir())[1]
        ):
            notes = (*notes, f"{why}; its pipeline class is checked when an actor fetches it")
        fields = type(self.sampling).model_fields
        given = {k: getattr(self.sampling, k) for k in SAMPLING_KEYS if k in self.sampling.model_fields_set}
        ours = {k: fields[k].default for k in SAMPLING_KEYS}
        text_length_given = "max_sequence_length" in self.model.model_fields_set
        return resolve(given, ours, found, given_scheduler, notes, text_length_given)

    @cached_property
    def model_licence(self) -> ModelLicence:
        """The model's licence: model.license, else what its model card names (read once per spec;
        for s3:// from the store, so validate, plan and run read it before any work), else for a
        named diffusers checkpoint (an hf:// one: its card is not read) its card's as ditfleet lists it."""
        if self.model.license is not None:
            return ModelLicence(self.model.license, JOB_SOURCE)
        path = self.model_path()
        local = (
            None if "://" in path and not path.startswith("file://") else Path(path.removeprefix("file://"))
        )
        found = read_model_licence(path, model_family(path).bundled_dir or local, self.s3_config())
        # A named diffusers checkpoint whose card is not read here (hf://): the licence its card
        # names, from the table of named checkpoints (model/diffusers_pipeline/published.py).
        named = self.sampling_defaults.checkpoint
        licence = getattr(named.schedule, "licence", None) if named is not None else None
        if found.id is None and licence is not None and named is not None:
            return ModelLicence(
                licence, f"{named.schedule.name}'s model card (ditfleet's table, {named.how})"
            )
        return found

    def check_licence(self) -> None:
        """Under model.require_commercial_licence, LicenceRefused unless the model's licence is
        known to permit commercial use."""
        if self.model.require_commercial_licence:
            self.model_licence.check_commercial()

    def resolved(self) -> dict[str, Any]:
        """The spec with every default and path filled in (JSON-safe): what `_job.json` stores,
        the model's licence as resolved (model.license) with where it came from and whether it
        permits commercial use (model.license_source, model.license_commercial_use)."""
        doc = self.model_dump(mode="json")
        licence = self.model_licence
        doc["model"].update(
            license=licence.id, license_source=licence.source, license_commercial_use=licence.commercial_use
        )
        doc["input"]["path"] = self.input_uri()
        doc["output"]["uri"] = self.output_uri()
        doc["model"]["path"] = self.model_path()
        doc["model"]["cache_dir"] = self.model_cache_dir()
        doc["model"]["loras"] = [{"path": a.path, "scale": a.scale} for a in self.model_loras()]
        doc["model"]["scheduler_config"] = self.model_scheduler_config()
        defaults = self.sampling_defaults
        doc["sampling"].update(defaults.values, defaults_from=defaults.sources)
        doc["buckets"]["names"] = self.bucket_names()
        doc["workers"]["max"] = self.workers.max or self.workers.min
        doc["workers"]["gpus"] = self.gpus_per_actor()
        return doc

    def row_config(self) -> RowConfig:
        buckets = BucketSet.from_names(self.bucket_names(), strict=self.buckets.strict)
        return settings_from(
            RowConfig,
            self.input,
            self.sampling,
            buckets=buckets,
            max_sources=self.max_sources(),
            **self.sampling_defaults.values,
        )

    def max_sources(self) -> int | None:
        """The most source images a row of this edit job may name (the model's, when its
        model_index.json is read here: a local or bundled model, an hf:// one read before any
        work); None for a text job and for a model not read here (each actor's pipeline refuses
        such a row, failing its shard)."""
        if self.input.image_column is None:
            return None
        path = _absolute(self.model.path.removeprefix("file://"), self.model.path)
        if path.startswith("hf://"):
            index, _ = check_hub_model(path, self.model_cache_dir())
            return None if index is None else model_max_sources(path, index)
        if "://" in path or not (
            os.path.isdir(path) or model_family(self.model.path).bundled_dir is not None
        ):
            return None
        try:
            return model_max_sources(path)
        except WeightsError:
            return None  # check_model_folder says what is wrong with the folder

    def pipeline_settings(self) -> PipelineSettings:
        """The pipeline's knobs, from whichever sections show them (model, sampling); the text
        length a diffusers checkpoint publishes where the job sets none (sampling_defaults)."""
        settings = settings_from(PipelineSettings, *self._sections())
        text_length = self.sampling_defaults.max_sequence_length
        return (
            settings
            if text_length is None
            else dataclasses.replace(settings, max_sequence_length=text_length[0])
        )

    def _sections(self) -> tuple[Section, ...]:
        return tuple(
            getattr(self, name)
            for name in type(self).model_fields
            if isinstance(getattr(self, name), Section)
        )

    def image_settings(self) -> dict[str, Any]:
        """What changes the stored bytes of an image, for the plan's fingerprint: the knobs the
        actors are given that are marked `fingerprint` where they are defined, with compile as
        planned for the actors' device, and the spec's own values: the model, and only when set
        (so that outputs planned before they existed keep their fingerprint) the job's name the
        files embed, the gate (with the CLIP model when it judges), adapters, a scheduler override."""
        worker, device = self.to_worker_config(), self.actor_device()
        # compile.vae "auto" depends on the device alone: the fingerprint records the bool. compile.dit
        # "auto" is off on CPU actors (CompileConfig.dit_on), recorded as False so that a CPU job keeps
        # the fingerprint it had when the default was false; on a GPU it stays "auto" (each actor
        # decides it from the same expected image count).
        dit = False if worker.compile.dit == "auto" and device == "cpu" else worker.compile.dit
        planned = dataclasses.replace(worker.compile, vae=worker.compile.vae_on(device), dit=dit)
        settings = fingerprint_entries(dataclasses.replace(worker, compile=planned))
        settings["model"] = worker.model_path
        if worker.writer.embed_metadata:
            settings.update(embed_metadata=True, job_name=worker.job_name)
            if worker.model_license is not None:  # the files name it
                settings["model_license"] = worker.model_license
        if worker.gate is not None:  # which try is stored
            settings["quality_gate"] = dataclasses.asdict(worker.gate)
            for row in needing((worker.gate.scorer,), MODEL):  # the gate's judge is a model of its own
                settings[row.setting or ""] = getattr(worker, row.setting or "")
        if worker.loras:
            settings["loras"] = [dataclasses.asdict(a) for a in worker.loras]
        if worker.scheduler_config:
            settings["scheduler_config"] = worker.scheduler_config
        return settings

    def actor_device(self) -> str:
        """The device type an actor runs the model on: "cpu" or "cuda"."""
        return "cpu" if self.model.device == "cpu" or self.gpus_per_actor() == 0 else "cuda"

    def memory_request(self, bucket_sources: Mapping[str, tuple[Size, ...]] | None = None) -> MemoryRequest:
        """What one actor asks of its GPU, for the memory plan (every bucket of the job).
        bucket_sources: an edit job's heaviest row's sources per bucket, as its plan read them
        (driver.plan.JobPlan.sources_per_bucket); a bucket without them takes
        workers.sources.planned_sources (one square source for an edit job)."""
        table = resolve_modulation_cache(self.model.modulation_cache, self.actor_device()) == "table"
        on_cpu = self.actor_device() == "cpu"
        step_cache = self.sampling.step_cache
        return MemoryRequest(
            model_path=self.model_path(),
            buckets=tuple(self.bucket_names()),
            batch_size=self.workers.batch_size,
            # auto is bf16 on a GPU, fp32 on the CPU (an actor without a GPU)
            dtype="fp32" if self.model.dtype == "fp32" or (on_cpu and self.model.dtype == "auto") else "bf16",
            text_encoder=self.model.text_encoder,
            gpu_memory_gb=self.workers.gpu_memory_gb,
            cfg=planned_cfg(self.sampling_defaults.values["true_cfg_scale"]),
            vae_batch=1 if self.compile_config().vae_on(self.actor_device()) else None,
            max_sequence_length=self.model.max_sequence_length,
            table_steps=(self.sampling_defaults.values["steps"],) if table else (),
            s3=self.s3_config(),
            device=self.actor_device(),
            quantization=self.pipeline_settings().quantization,
            fp8_layers=self.pipeline_settings().fp8_layers,
            step_cache_tensors=step_cache.kept_tensors() if step_cache is not None else 0,
            vqa=bool(needing(self.scorer_names(), PIPELINE_QWEN_VL)),
            sources=planned_sources(self.input.image_column),
            bucket_sources=dict(bucket_sources or {}),
        )

    def s3_config(self) -> S3Config:
        return settings_from(S3Config, self.s3)

    def to_driver_config(self) -> DriverConfig:
        """The driver's config; refuses (LicenceRefused) a licence the job does not accept, so
        validate, plan and run all refuse it before any work."""
        self.check_licence()
        check_schedule(self.sampling.step_cache, self.sampling_defaults.values["steps"])
        w = self.workers
        return DriverConfig(
            input_uri=self.input_uri(),
            output_uri=self.output_uri(),
            plan=settings_from(
                PlanConfig, *self._sections(), rows=self.row_config(), image_settings=self.image_settings()
            ),
            dispatch=settings_from(
                DispatchConfig, *self._sections(), max_actors=w.max or w.min, num_gpus=self.gpus_per_actor()
            ),
            s3=self.s3_config(),
            resolved_spec=json.dumps(self.resolved(), sort_keys=True),
            incremental=self.input.incremental,
            shared_filesystem=self.output.shared_filesystem,
            cost=settings_from(CostConfig, self.cost),
        )

    def compile_config(self) -> CompileConfig:
        """The compile section as the actor's CompileConfig (no torch)."""
        return settings_from(CompileConfig, *self._sections())

    def to_worker_config(self) -> WorkerConfig:
        sections = self._sections()
        return settings_from(
            WorkerConfig,
            *sections,
            output_uri=self.output_uri(),
            rows=self.row_config(),
            model_path=self.model_path(),
            model_cache_dir=self.model_cache_dir(),
            placement=settings_from(ModelPlacement, *sections),
            pipeline=self.pipeline_settings(),
            loras=self.model_loras(),
            scheduler_config=self.model_scheduler_config(),
            compile=self.compile_config(),
            compile_cache_key=settings_from(CacheSecretSource, *sections),
            writer=settings_from(ShardWriterConfig, self.output),
            job_name=self.name,
            model_license=self.model_licence.id,
            gate=self.gate_config(),
            clip_model=_absolute(self.quality.clip_model) if self.quality.clip_model else None,
            s3=self.s3_config(),
        )

    def gate_config(self) -> GateConfig | None:
        """quality.gate as the actor's GateConfig (None: no gate)."""
        gate = self.quality.gate
        return settings_from(GateConfig, gate) if gate is not None else None


def _merged(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def check_model_folder(model_path: str) -> None:
    """ValueError for a local model folder whose model_index.json names a pipeline that cannot run
    here (a diffusers class diffusers lacks, one that is not text-to-image, a missing package):
    validate, plan and run refuse it before any work. A folder that is not there yet, a bundled
    model and remote checkpoints are checked where they are fetched."""
    path = _absolute(model_path.removeprefix("file://"), model_path)
    if "://" in path or not os.path.isdir(path):
        return
    try:
        check_model_index(path)
    except WeightsError as e:
        raise ValueError(f"model.path: {e}") from None


@lru_cache(maxsize=16)
def check_hub_model(model_path: str, cache_dir: str) -> tuple[dict | None, str | None]:
    """An hf:// checkpoint's model_index.json read before any work (workers.weights.hub: a hub
    cache, else that one file from the hub), so its family is known on the driver
    (model.family.remember_remote_index) and one that cannot run here is refused (ValueError,
    naming what to do). Returns (the index, None), or (None, why it could not be read: the actor
    then checks it; `plan` says so). Read once per process and path."""
    try:
        index, why = read_hub_index(model_path, [Path(cache_dir)] if "://" not in cache_dir else [])
    except ModelFetchError as e:  # a malformed hf:// path
        raise ValueError(f"model.path: {e}") from None
    if index is None:
        return None, why
    try:
        remember_remote_index(model_path, index)
    except WeightsError as e:
        raise ValueError(f"model.path: {e}") from None
    return index, None


def check_model_task(model_path: str, image_column: str | None) -> None:
    """ValueError for an edit job on a text-to-image model or a text job on an edit model, for a
    bundled model or a local folder (validate, plan and run refuse it before any work); a remote
    model's model_index.json is read where it is fetched, and each actor checks it there."""
    path = _absolute(model_path.removeprefix("file://"), model_path)
    if "://" in path or not (os.path.isdir(path) or model_family(model_path).bundled_dir is not None):
        return
    try:
        task = model_task(path)
    except WeightsError:
        return  # check_model_folder says what is wrong with the folder
    problem = task_problem(model_path, task, image_column)
    if problem is not None:
        raise ValueError(problem)


def _absolute(path: str, model: str | None = None) -> str:
    """s3:// and file:// URIs as given; a local path made absolute (against the current dir).
    model: the job's model.path, when `path` is it: a bundled model's (its family says) is a
    name, kept as given."""
    if "://" in path or (model is not None and model_family(model).bundled_dir is not None):
        return path
    return os.path.abspath(os.path.expanduser(path))
