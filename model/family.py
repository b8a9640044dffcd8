"""The model's face: what the layers above model/ may know about a model family, in one place.

    family = model_family(spec_model_path)   # or a loaded pipeline, or a family
    family.default_buckets                   # ((1328, 1328), (1664, 928), ...): (width, height)
    family.runs_on_cpu                       # an actor needs no GPU unless the job says so
    family.compile_regions                   # what torch.compile wraps, with its dynamic dims
    family.text_conditioning(pipe)           # (embedding width, longest prompt in tokens)
    family.attention_counters(pipe)          # counters of the DiT's attention calls
    family.memory                            # the memory formula (model.memory) from configs
    family.forward_flops(config, w, h, L)    # FLOPs of one DiT forward: "% of peak" one way
    family.published_config(rel, layers)     # its model at the published widths (the self-test's)
    family.toy_config(rel, layers)           # ... and at toy widths (the self-test's --tiny)
    family.empty_transformer(config)         # its DiT / VAE of a config, on the meta device
    family.text_width(config)                # the DiT's prompt-embedding width; attention_shape
    family.bundled_dir                       # the folder of a model that ships with ditfleet, else None
    family.scorer_inputs                     # what it offers the image scorers (model.quality.table)
    family.task(model_index)                 # "text-to-image" or "edit" (from its `_class_name`)
    model_task(model_path)                   # the same for a model path ("tiny", a folder, ...)
    family.max_sources(model_index)          # the most source images a row may give it (None: any)
    model_max_sources(model_path)            # the same for a model path
    source_size(w, h)                        # an edit model's VAE size for a w x h source (its tokens: /16)
    source_prompt_tokens(path, sources)      # the prompt tokens an edit model's encoder gives those sources
    family.load_text_encoder(root, dev, dt)  # a native family's: its text encoder apart from the DiT
    family.runs_scaled_gemms(pipe)           # ... whether its DiT runs FP8 GEMMs (compile policy)
    family.prepare_inputs                    # ... its DiT's inputs for one call of the shared loop
    family.dit_config(config)                # ... its DiT config object (the self-test's)
    family.quantize(dit, mode, layers)       # ... a loaded DiT quantized in place (the self-test's FP8 copy)

The published checkpoints' sampling defaults (a family's `published/schedules.py`), which the job
spec reads at plan time: `schedule_by_lora(file)`, `schedule_by_scheduler(config)`,
`schedule_by_hub_id(repo)` -> PublishedSchedule | None, `schedule_twins(schedule)` (the published
checkpoints a scheduler config cannot tell it from); `published_file("published:<folder>/<file>")`
(PUBLISHED_SCHEME) is such a file in this node's installed package.

compile/, workers/, driver/ and jobs/ ask the family and never name a submodule, method or
constant of a family's DiT themselves, nor import a family's folder (ditfleet.model.qwen_image...):
tests/unit/test_model_face.py parses them.

A family is a folder of model/ (model/qwen_image/: Qwen-Image; the bundled tiny model is a
configuration of it) and one row of `FAMILIES`, keyed by the `_class_name` a checkpoint's
`model_index.json` names, as diffusers' auto pipeline picks its pipeline class. What the loader
accepts is that table; `family_of_class` is its one lookup.

Standard library only (the memory formula and the config readers are torch-free): the job spec
and the driver's planning read the defaults without loading torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ditfleet.model.diffusers_pipeline.family import DiffusersFamily
from ditfleet.model.diffusers_pipeline.index import (
    DiffusersPipelineError,
    PipelineIndex,
    check_runnable,
    components_of,
    read_components,
)
from ditfleet.model.diffusers_pipeline.published import PublishedDefaults
from ditfleet.model.diffusers_pipeline.published import for_checkpoint as _diffusers_defaults
from ditfleet.model.family_types import (
    EDIT,
    TASKS,
    TEXT_TO_IMAGE,
    AttentionCounters,
    CompileRegion,
    DiTConfig,
    Size,
    SourceSizes,
    TextConditioning,
)
from ditfleet.model.loading.folder import (
    TINY_EDIT_MODEL,
    TINY_MODEL,
    WeightsError,
    model_dir_layout,
    read_model_index,
)
from ditfleet.model.qwen_image.edit import EDIT_STYLES, source_size
from ditfleet.model.qwen_image.family import QWEN_IMAGE, QWEN_IMAGE_CLASSES, TINY, TINY_EDIT, MemoryFormula

if TYPE_CHECKING:  # the pipeline needs torch; this module is read without it
    from ditfleet.model.generation.pipeline import TextToImagePipeline
    from ditfleet.model.generation.sampling import PrepareInputs
from ditfleet.model.qwen_image.published.schedules import (
    PUBLISHED_SCHEME,
    SCHEDULER_FILE,
    PublishedSchedule,
    published_file,
)
from ditfleet.model.qwen_image.published.schedules import by_hub_id as schedule_by_hub_id
from ditfleet.model.qwen_image.published.schedules import by_lora as schedule_by_lora
from ditfleet.model.qwen_image.published.schedules import by_scheduler as schedule_by_scheduler
from ditfleet.model.qwen_image.published.schedules import trajectory_twins as schedule_twins

__all__ = [
    "AttentionCounters",
    "CompileRegion",
    "DEFAULT_FAMILY",
    "EDIT",
    "FAMILIES",
    "MemoryFormula",
    "NativeFamily",
    "ModelFamily",
    "PUBLISHED_SCHEME",
    "PublishedDefaults",
    "PublishedSchedule",
    "SCHEDULER_FILE",
    "Size",
    "SourceSizes",
    "TASKS",
    "TEXT_TO_IMAGE",
    "TextConditioning",
    "check_model_index",
    "components_of",
    "remember_remote_index",
    "family_of_class",
    "load_pipeline",
    "load_text_encoder",
    "model_family",
    "model_max_sources",
    "model_task",
    "published_file",
    "resolve_model_dir",
    "runs_scaled_gemms",
    "schedule_by_checkpoint",
    "schedule_by_hub_id",
    "schedule_by_lora",
    "schedule_by_scheduler",
    "schedule_twins",
    "source_prompt_tokens",
    "source_size",
]


@runtime_checkable
class ModelFamily(Protocol):
    """What the layers above model/ know about a model family; see the module docstring.

    The data members are read-only properties: a family is frozen, and a frozen dataclass's
    fields satisfy a read-only member, not a settable one."""

    @property
    def name(self) -> str: ...

    @property
    def default_buckets(self) -> tuple[Size, ...]: ...  # (width, height); the first is the default size

    @property
    def runs_on_cpu(self) -> bool: ...  # actors get no GPU unless the job asks for one

    @property
    def compile_regions(self) -> tuple[CompileRegion, ...]: ...

    @property
    def memory(self) -> MemoryFormula: ...

    @property
    def bundled_dir(self) -> Path | None: ...  # a bundled model's folder (its path is a name, kept as is)

    @property
    def scorer_inputs(self) -> frozenset[str]: ...  # model.quality.table needs it meets (PIPELINE_QWEN_VL)

    def task(self, model_index: dict) -> str:
        """TEXT_TO_IMAGE or EDIT: what a checkpoint of this family whose model_index.json holds
        `model_index` does (from its `_class_name`). An edit model takes source images
        (`encode_guidance(..., sources=...)`) and runs only edit jobs (`input.image_column`)."""
        ...

    def max_sources(self, model_index: dict) -> int | None:
        """The most source images one row may give a checkpoint whose model_index.json holds
        `model_index` (None: any number; 0: a text-to-image one, which takes none). The job's
        validation refuses a row with more, before any work (driver.input.validate)."""
        ...

    def text_conditioning(self, pipe: Any) -> TextConditioning: ...

    def attention_counters(self, pipe: Any) -> AttentionCounters: ...

    def forward_flops(
        self, transformer_config: dict, width: int, height: int, text_tokens: int, sources: SourceSizes = ()
    ) -> float:
        """FLOPs of one DiT forward, one image of width x height, from the transformer's config.json;
        an edit's `sources` (each source image's (width, height)) add the tokens the family gives them."""
        ...

    @property
    def published_dir(self) -> Path: ...  # the published checkpoint's config files

    def published_config(self, rel: str, num_layers: int | None = None) -> dict:
        """A published config file; with num_layers, the transformer's cut to that depth."""
        ...

    def load_pipeline(self, path: str | Path, *args: Any, **kwargs: Any) -> TextToImagePipeline: ...


@runtime_checkable
class NativeFamily(ModelFamily, Protocol):
    """A family implemented in model/ (its own folder), whose model the node self-test builds
    with random weights at toy and published widths (workers/selftest/) and checks against the
    reference implementation. A family run through another library's pipeline
    (model.diffusers_pipeline) is a ModelFamily only."""

    def toy_config(self, rel: str, num_layers: int | None = None) -> dict:
        """`published_config` at toy widths (the self-test's --tiny)."""
        ...

    def empty_transformer(self, config: dict) -> Any:
        """The DiT of a transformer config.json's contents, on the meta device."""
        ...

    def empty_vae(self, config: dict, with_encoder: bool = True) -> Any:
        """The VAE of a vae config.json's contents, on the meta device."""
        ...

    def write_random_vae(self, out_dir: Path, config: dict, seed: int = 0) -> None:
        """A VAE of `config` with random weights, written in the hub's layout."""
        ...

    def reference_transformer(self, ours: Any, dtype: Any) -> Any:
        """The reference implementation's (diffusers') DiT on the weights of `ours`, in `dtype`."""
        ...

    def fuse_projections(self, transformer: Any, on: bool = True) -> int:
        """The DiT's fused projections as the loader sets them up (on), or the separate ones
        (off): the self-test times both. Returns the layers fused."""
        ...

    def text_width(self, transformer_config: dict) -> int: ...  # the prompt embeddings' width

    def attention_shape(self, transformer_config: dict) -> tuple[int, int]: ...  # (heads, head dim)

    @property
    def prepare_inputs(self) -> PrepareInputs: ...  # its DiT's keyword arguments for one call of the loop

    def load_text_encoder(self, root: Path, device: Any, dtype: Any) -> Any:
        """The text encoder of the model folder `root` on `device`; None when it has none."""
        ...

    def random_text_encoder(
        self, config: dict, tokenizer: Any, device: Any, dtype: Any, seed: int = 0
    ) -> Any:
        """Its text encoder of a text_encoder config.json's contents, random weights, with `tokenizer`."""
        ...

    def runs_scaled_gemms(self, pipe: Any) -> bool:
        """Whether the pipeline's DiT runs FP8 GEMMs through torch._scaled_mm (compile.policy)."""
        ...

    def dit_config(self, config: dict) -> DiTConfig:
        """Its DiT's config of a transformer config.json's contents (checked, defaults filled)."""
        ...

    def quantize(self, model: Any, mode: Any, layers: Any) -> Any:
        """Its loaded DiT `model` quantized in place (model.quantization `mode`, the layer set `layers`)."""
        ...

    def check_quantization_device(self, mode: Any, device: Any) -> None:
        """QuantizationError when `mode` cannot run on `device` (fp8 on a GPU without FP8 units)."""
        ...


# The one table: a checkpoint's model_index.json `_class_name` -> its family.
# Qwen-Image's rows: text-to-image and its edit models (Qwen-Image-Edit, -2509, -2511), one DiT.
FAMILIES: Mapping[str, NativeFamily] = MappingProxyType({name: QWEN_IMAGE for name in QWEN_IMAGE_CLASSES})
# The family of a model folder without model_index.json, of a remote path (not read on the
# driver) and of configs built without naming a model.
DEFAULT_FAMILY: NativeFamily = QWEN_IMAGE


def family_of_class(class_name: Any, where: str, index: dict | None = None) -> ModelFamily:
    """The family of a checkpoint whose model_index.json (`where`) names `class_name`.

    The one lookup of `FAMILIES`: a family for classes without a native one hooks in here.
    index: the model_index.json's contents when read elsewhere (an object store); else read
    from `where` when a class without a native family needs its components."""
    family = FAMILIES.get(class_name) if isinstance(class_name, str) else None
    if family is None and isinstance(class_name, str) and class_name:
        # No native family: diffusers' own pipeline class, when it can run here as text-to-image
        # (refused otherwise, naming what to do: model.diffusers_pipeline.index).
        try:
            components = components_of(index) if index is not None else read_components(where)
            check_runnable(PipelineIndex(where, class_name, components))
        except DiffusersPipelineError as e:
            raise WeightsError(str(e)) from None
        return DiffusersFamily(class_name)
    if family is None:
        raise WeightsError(
            f"{where}: _class_name is {class_name!r}; ditfleet runs {sorted(FAMILIES)} checkpoints "
            "(Qwen-Image and Qwen-Image-Edit). Point the model path at one of those."
        )
    return family


# The model_index.json of remote checkpoints (hf://) as read on this machine before any work
# (jobs.spec reads it from a hub cache or the hub): the family of such a path is its class's.
_REMOTE_INDEX: dict[str, dict] = {}


def remember_remote_index(model_path: str, index: dict) -> ModelFamily:
    """The family of the remote checkpoint `model_path` whose model_index.json is `index`
    (refused, WeightsError, when it cannot run here); model_family(model_path) answers it from
    now on in this process."""
    family = family_of_class(index.get("_class_name"), f"{model_path} (model_index.json)", index)
    _REMOTE_INDEX[model_path] = index
    return family


def check_model_index(root: str | Path) -> ModelFamily:
    """The family of a local model folder from its model_index.json; refuses a checkpoint of a
    pipeline no family runs (an edit or layered model, Flux, ...) up front.

    model_index.json is optional (a hand-assembled folder may lack it): then `DEFAULT_FAMILY`."""
    index = read_model_index(root)
    if index is None:
        return DEFAULT_FAMILY
    return family_of_class(index.get("_class_name"), str(Path(root) / "model_index.json"))


# The bundled models' families by the name a job gives (model.loading.folder.BUNDLED_MODELS).
BUNDLED_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({TINY_MODEL: TINY, TINY_EDIT_MODEL: TINY_EDIT})


def resolve_model_dir(path: str | Path) -> Path:
    """ "tiny" -> the bundled model; else a local directory in the diffusers layout, whose
    model_index.json (when it has one) names a class of `FAMILIES`."""
    root = model_dir_layout(path)
    check_model_index(root)
    return root


def model_family(source: Any) -> ModelFamily:
    """The family of a model path as a job names it ("tiny", a folder, s3://..., hf://...), of a
    loaded pipeline (by the model id it was loaded as), or a family itself.

    "tiny" is the tiny model; a local folder's family is its model_index.json's class, and so is
    a remote one's whose index was read (remember_remote_index); any other path (remote, not read
    here) is `DEFAULT_FAMILY`, whose configs refuse another model when read.
    """
    if isinstance(source, ModelFamily):
        return source
    if not isinstance(source, (str, os.PathLike)):
        own = getattr(source, "family", None)  # a pipeline that knows its family (diffusers')
        if isinstance(own, ModelFamily):
            return own
        model_id = getattr(source, "model_id", None)
        if model_id is None:
            raise TypeError(
                f"model_family takes a model path or a loaded pipeline, got {type(source).__name__}"
            )
        source = model_id
    if str(source) in BUNDLED_FAMILIES:
        return BUNDLED_FAMILIES[str(source)]
    if (index := _REMOTE_INDEX.get(str(source))) is not None:
        return family_of_class(index.get("_class_name"), f"{source} (model_index.json)", index)
    return check_model_index(source) if Path(source).is_dir() else DEFAULT_FAMILY


def schedule_by_checkpoint(model_path: str, family: ModelFamily) -> tuple[PublishedDefaults, str] | None:
    """The sampling defaults of a checkpoint run through diffusers (a hub id in
    model.diffusers_pipeline.published's table, else its pipeline class's `__call__` defaults),
    with how it was recognised; None for a native family's checkpoint."""
    class_name = family.class_name if isinstance(family, DiffusersFamily) else None
    return _diffusers_defaults(model_path, class_name)


def model_task(model_path: str | os.PathLike, model_index: dict | None = None) -> str:
    """TEXT_TO_IMAGE or EDIT for a model path as a job names it: its family's `task` of its
    model_index.json. A bundled model's ("tiny", "tiny-edit") is its folder's; a folder without
    model_index.json and a remote path (not read here) are text-to-image unless `model_index`
    (read elsewhere, e.g. from an object store) says otherwise."""
    family, index = _family_and_index(model_path, model_index)
    return family.task(index)


def model_max_sources(model_path: str | os.PathLike, model_index: dict | None = None) -> int | None:
    """The most source images a row may give the model at `model_path` (its family's
    `max_sources` of its model_index.json; None: any number), read as model_task reads it: a
    remote path not read here (s3://) answers its default family's text-to-image 0 unless
    `model_index` is given or was read (an hf:// one's, remember_remote_index)."""
    family, index = _family_and_index(model_path, model_index)
    return family.max_sources(index)


def _family_and_index(model_path: str | os.PathLike, model_index: dict | None) -> tuple[ModelFamily, dict]:
    """The family of a model path and the model_index.json it is judged by ({} without one)."""
    where = f"{model_path}/model_index.json"
    if model_index is None:
        model_index = _REMOTE_INDEX.get(str(model_path))
    if model_index is None:
        bundled = BUNDLED_FAMILIES.get(str(model_path))
        root = bundled.bundled_dir if bundled is not None and bundled.bundled_dir else Path(model_path)
        local = read_model_index(root)
        if local is None:
            return model_family(model_path), {}
        model_index = local
    if not isinstance(model_index, dict):
        raise WeightsError(f"{where}: not a JSON object (a model_index.json names its `_class_name`).")
    return family_of_class(model_index.get("_class_name"), where, model_index), model_index


def source_prompt_tokens(
    model_path: str | os.PathLike, sources: SourceSizes, model_index: dict | None = None
) -> int:
    """The tokens an edit checkpoint's text encoder adds to each prompt for a row whose sources
    are `sources` ((width, height) each, as read): Qwen2.5-VL's vision tokens of each and their
    markers (model.qwen_image.edit.EditStyle.prompt_tokens). The prompt the DiT sees is the
    instruction's tokens plus these, so the memory plan counts them in its text length. 0 for a
    text-to-image checkpoint and for one whose conditioning is not a native family's (a pipeline
    run through diffusers is measured on the actor, not planned). `model_index` as for model_task."""
    if not sources:
        return 0
    if model_index is None:
        remote = _REMOTE_INDEX.get(str(model_path))  # an s3:// checkpoint's, read while planning
        model_index = remote or (None if str(model_path) == TINY_MODEL else read_model_index(model_path))
    name = (model_index or {}).get("_class_name")
    style = EDIT_STYLES.get(name) if isinstance(name, str) else None
    return 0 if style is None else sum(style.prompt_tokens(w, h) for w, h in sources)


def load_pipeline(path: str | Path, *args: Any, **kwargs: Any) -> TextToImagePipeline:
    """The checkpoint at `path` ("tiny" or a local folder) loaded by its family (see
    `model.qwen_image.loader.load_pipeline` for the arguments)."""
    return model_family(resolve_model_dir(path) if str(path) not in BUNDLED_FAMILIES else path).load_pipeline(
        path, *args, **kwargs
    )


def load_text_encoder(path: str | Path, device: Any, dtype: Any) -> Any:
    """The text encoder of the natively run model at `path` ("tiny" or a local folder) on
    `device`, by its family; None when the model has none. What an actor places away from the
    DiT and the vqa scorer's Qwen2.5-VL are loaded here."""
    family = model_family(path)
    if not isinstance(family, NativeFamily):
        raise WeightsError(
            f"{path}: a {family.name} model runs through its library's own pipeline, which loads its "
            "own text encoder; ditfleet loads one separately only for a native family's model."
        )
    return family.load_text_encoder(resolve_model_dir(path), device, dtype)


def runs_scaled_gemms(pipe: Any) -> bool:
    """Whether the pipeline's DiT runs FP8 GEMMs through torch._scaled_mm, which decides
    compile.dit "auto" (compile.policy.resolve_auto). A native family's answer; a pipeline run
    through another library has none of ours."""
    family = model_family(pipe)
    return isinstance(family, NativeFamily) and family.runs_scaled_gemms(pipe)
