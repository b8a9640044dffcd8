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
    source_size(w, h)                        # an edit model's VAE size for a w x h source (its tokens: /16)

The published checkpoints' sampling defaults (a family's `published/schedules.py`), which the job
spec reads at plan time: `schedule_by_lora(file)`, `schedule_by_scheduler(config)`,
`schedule_by_hub_id(repo)` -> PublishedSchedule | None; `published_file("published:<folder>/<file>")`
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

import json
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
from ditfleet.model.family_types import (
    EDIT,
    TASKS,
    TEXT_TO_IMAGE,
    AttentionCounters,
    CompileRegion,
    Size,
    TextConditioning,
)
from ditfleet.model.loading.folder import TINY_EDIT_MODEL, TINY_MODEL, WeightsError, model_dir_layout
from ditfleet.model.qwen_image.edit import source_size
from ditfleet.model.qwen_image.family import QWEN_IMAGE, QWEN_IMAGE_CLASSES, TINY, TINY_EDIT, MemoryFormula

if TYPE_CHECKING:  # the pipeline needs torch; this module is read without it
    from ditfleet.model.generation.pipeline import TextToImagePipeline
from ditfleet.model.qwen_image.published.schedules import (
    PUBLISHED_SCHEME,
    SCHEDULER_FILE,
    PublishedSchedule,
    published_file,
)
from ditfleet.model.qwen_image.published.schedules import by_hub_id as schedule_by_hub_id
from ditfleet.model.qwen_image.published.schedules import by_lora as schedule_by_lora
from ditfleet.model.qwen_image.published.schedules import by_scheduler as schedule_by_scheduler

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
    "PublishedSchedule",
    "SCHEDULER_FILE",
    "Size",
    "TASKS",
    "TEXT_TO_IMAGE",
    "TextConditioning",
    "check_model_index",
    "family_of_class",
    "load_pipeline",
    "model_family",
    "model_task",
    "published_file",
    "resolve_model_dir",
    "schedule_by_hub_id",
    "schedule_by_lora",
    "schedule_by_scheduler",
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

    def text_conditioning(self, pipe: Any) -> TextConditioning: ...

    def attention_counters(self, pipe: Any) -> AttentionCounters: ...

    def forward_flops(self, transformer_config: dict, width: int, height: int, text_tokens: int) -> float:
        """FLOPs of one DiT forward, one image of width x height, from the transformer's config.json."""
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

    def text_width(self, transformer_config: dict) -> int: ...  # the prompt embeddings' width

    def attention_shape(self, transformer_config: dict) -> tuple[int, int]: ...  # (heads, head dim)


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


def check_model_index(root: str | Path) -> ModelFamily:
    """The family of a local model folder from its model_index.json; refuses a checkpoint of a
    pipeline no family runs (an edit or layered model, Flux, ...) up front.

    model_index.json is optional (a hand-assembled folder may lack it): then `DEFAULT_FAMILY`."""
    path = Path(root) / "model_index.json"
    if not path.is_file():
        return DEFAULT_FAMILY
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e}).") from e
    return family_of_class(index.get("_class_name") if isinstance(index, dict) else None, str(path))


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

    "tiny" is the tiny model; a local folder's family is its model_index.json's class; any other
    path (remote, not read here) is `DEFAULT_FAMILY`, whose configs refuse another model when read.
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
    return check_model_index(source) if Path(source).is_dir() else DEFAULT_FAMILY


def model_task(model_path: str | os.PathLike, model_index: dict | None = None) -> str:
    """TEXT_TO_IMAGE or EDIT for a model path as a job names it: its family's `task` of its
    model_index.json. A bundled model's ("tiny", "tiny-edit") is its folder's; a folder without
    model_index.json and a remote path (not read here) are text-to-image unless `model_index`
    (read elsewhere, e.g. from an object store) says otherwise."""
    if model_index is None:
        bundled = BUNDLED_FAMILIES.get(str(model_path))
        root = bundled.bundled_dir if bundled is not None and bundled.bundled_dir else Path(model_path)
        path = root / "model_index.json"
        if not path.is_file():
            return model_family(model_path).task({})
        try:
            model_index = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WeightsError(f"{path}: not valid JSON ({e}).") from e
        where = str(path)
    else:
        where = f"{model_path}/model_index.json"
    if not isinstance(model_index, dict):
        raise WeightsError(f"{where}: not a JSON object.")
    return family_of_class(model_index.get("_class_name"), where, model_index).task(model_index)


def load_pipeline(path: str | Path, *args: Any, **kwargs: Any) -> TextToImagePipeline:
    """The checkpoint at `path` ("tiny" or a local folder) loaded by its family (see
    `model.qwen_image.loader.load_pipeline` for the arguments)."""
    return model_family(resolve_model_dir(path) if str(path) not in BUNDLED_FAMILIES else path).load_pipeline(
        path, *args, **kwargs
    )
