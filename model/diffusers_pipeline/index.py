"""What a diffusers checkpoint folder is, read without torch or diffusers being imported.

    info = read_index(folder)              # its model_index.json: pipeline class, components
    check_runnable(info)                   # refuses (DiffusersPipelineError) what cannot run here

The driver (validate, plan, run) calls these before any work: importing diffusers would import
torch, which the driver never does (tests/unit/jobs/test_cli_imports.py). So the pipeline class
is looked up in diffusers' installed source with `ast`: it must exist, and its `__call__` must
take a `prompt`, the size, the step count and generators. A `__call__` that also takes an `image`
is an edit (image-to-image, Kontext): its task is "edit" (`pipeline_task`), the
job's source images go there. Each component's library (transformers, ...) must be installed.
The `__call__`'s published defaults (`call_defaults`: its steps, guidance, text length) are read
from the same source.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ditfleet.model.family_types import EDIT, TEXT_TO_IMAGE

# What `__call__` must take for ditfleet to drive it as text-to-image with one generator per image.
REQUIRED_CALL_PARAMETERS = ("prompt", "height", "width", "num_inference_steps", "generator")
INSTALL_HINT = "pip install 'ditfleet[diffusers]'"
# What an edit job gives a pipeline: prompts and source images. A `__call__` that needs another
# input ditfleet has no column for (a mask, a control image) cannot run; nor can a pipeline that
# makes video (refused by name, as diffusers names them).
NEEDS_OTHER_INPUT = ("mask_image", "control_image", "image_reference")
NOT_IMAGES = re.compile(r"Video|Wan|Animate|I2V|T2V")
# `__call__` takes an `image`, but also makes images from text alone (its image is optional):
# the FLUX.2 pipelines and Qwen-Image 2.1 (issue 49 names them as text-to-image models). Their
# task is text-to-image; sources given to them still go to `image`.
IMAGE_OPTIONAL = frozenset({"Flux2Pipeline", "Flux2KleinPipeline", "QwenImage21Pipeline"})


class DiffusersPipelineError(ValueError):
    """A checkpoint ditfleet cannot run through diffusers; the message says what to do."""


@dataclass(frozen=True)
class PipelineIndex:
    """A checkpoint's model_index.json: its pipeline class and components (name -> [library, class])."""

    where: str  # the model_index.json path, for messages
    class_name: str
    components: dict[str, tuple[str | None, str | None]]


def read_index(root: str | Path) -> PipelineIndex | None:
    """The folder's model_index.json, or None when it has none (a hand-assembled native folder)."""
    path = Path(root) / "model_index.json"
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DiffusersPipelineError(f"{path}: not readable JSON ({e}).") from e
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(cls, str) or not cls:
        raise DiffusersPipelineError(
            f"{path}: no _class_name; a diffusers checkpoint names its pipeline class."
        )
    return PipelineIndex(str(path), cls, components_of(index))


def components_of(index: dict) -> dict[str, tuple[str | None, str | None]]:
    """The components a model_index.json's contents name: name -> (library, class)."""
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2
    }


def read_components(index_path: str) -> dict[str, tuple[str | None, str | None]]:
    """The components a model_index.json names (empty when it cannot be read)."""
    try:
        info = read_index(Path(index_path).parent)
    except DiffusersPipelineError:
        return {}
    return info.components if info is not None else {}


def diffusers_version() -> str | None:
    """The installed diffusers' version, None when it is not installed (the optional extra)."""
    if importlib.util.find_spec("diffusers") is None:
        return None
    return importlib.metadata.version("diffusers")


def check_runnable(info: PipelineIndex) -> tuple[str, ...]:
    """Refuse a checkpoint this machine cannot run as text-to-image through diffusers; return its
    `__call__`'s parameter names. Raises DiffusersPipelineError naming what to do."""
    version = diffusers_version()
    if version is None:
        raise DiffusersPipelineError(
            f"{info.where}: _class_name {info.class_name!r} runs through diffusers, which is not "
            f"installed. Install the optional extra: {INSTALL_HINT}."
        )
    missing = sorted(
        {
            lib
            for lib, cls in info.components.values()
            if lib and cls and importlib.util.find_spec(lib) is None
        }
    )
    if missing:
        raise DiffusersPipelineError(
            f"{info.where}: its components need {missing}, not installed here. Install them "
            f"(pip install {' '.join(missing)}) on the driver and the workers' image."
        )
    if not info.components:
        raise DiffusersPipelineError(
            f"{info.where}: _class_name {info.class_name!r} but no components listed; a diffusers checkpoint's "
            "model_index.json names each component's library and class. Point model.path at the whole checkpoint."
        )
    params = call_parameters(info.class_name)
    if params is None:
        raise DiffusersPipelineError(
            f"{info.where}: diffusers {version} has no pipeline class {info.class_name!r}. Upgrade diffusers "
            "(pip install -U diffusers) or point model.path at a checkpoint of a pipeline it has."
        )
    other = [p for p in NEEDS_OTHER_INPUT if p in params]
    if other or NOT_IMAGES.search(info.class_name):
        what = f"needs {other}, an input" if other else "makes video, an output"
        raise DiffusersPipelineError(
            f"{info.where}: {info.class_name} {what} ditfleet's jobs do not have (a job gives prompts, and an "
            "edit job source images: input.image_column). Point model.path at a text-to-image or edit checkpoint "
            "(e.g. FluxPipeline, FluxKontextPipeline, StableDiffusion3Img2ImgPipeline)."
        )
    lacking = [p for p in REQUIRED_CALL_PARAMETERS if p not in params]
    if lacking:
        raise DiffusersPipelineError(
            f"{info.where}: {info.class_name}.__call__ takes no {lacking}: it is not a text-to-image or edit "
            "pipeline ditfleet can drive (a prompt and an output size in, one generator per image). Point "
            "model.path at one (e.g. FluxPipeline, StableDiffusion3Pipeline, ZImagePipeline, FluxKontextPipeline)."
        )
    return params


def pipeline_task(class_name: str, params: tuple[str, ...] | None = None) -> str:
    """ "edit" for a pipeline whose `__call__` takes an `image` (and needs it), else "text-to-image"."""
    params = call_parameters(class_name) if params is None else params
    takes_image = params is not None and "image" in params
    return EDIT if takes_image and class_name not in IMAGE_OPTIONAL else TEXT_TO_IMAGE


# How many sources a row may give a pipeline, from its `__call__`'s `image` annotation: diffusers'
# image-batch types (PipelineImageInput, tensors, arrays) take a list as one image per prompt, so
# a row gives one; a list of PIL images only (FLUX.2, Bria FIBO, Z-Image Omni) or of whole inputs
# (list[PipelineImageInput]) is one prompt's references, any number.
_REFERENCE_LISTS = re.compile(r"\b[Ll]ist\[\s*PipelineImageInput\s*\]")
_IMAGE_BATCH = re.compile(r"PipelineImageInput|Tensor|ndarray")
_ANY_LIST = re.compile(r"\b[Ll]ist\[")


def pipeline_max_sources(class_name: str) -> int | None:
    """The most source images one prompt's `image` takes in `diffusers.<class_name>.__call__`:
    None (any number) when its annotation is a list of references, 1 when it is one image (or a
    batch of one per prompt), 0 when `__call__` takes no image (text-to-image)."""
    call = _call_node(class_name)
    image = None if call is None else next((a for a in _all_args(call.args) if a.arg == "image"), None)
    if image is None:
        return 0
    text = "" if image.annotation is None else ast.unparse(image.annotation)
    if _REFERENCE_LISTS.search(text) or (_ANY_LIST.search(text) and not _IMAGE_BATCH.search(text)):
        return None
    return 1


def call_parameters(class_name: str) -> tuple[str, ...] | None:
    """The parameter names of `diffusers.<class_name>.__call__` from diffusers' source (its own or
    a base class's, by name); None when diffusers has no such pipeline class."""
    signature = call_signature(class_name)
    return None if signature is None else tuple(signature)


# A default the source does not spell as a literal (a constant's name, an expression).
NOT_LITERAL = object()


def call_defaults(class_name: str) -> dict[str, object]:
    """The literal defaults of `diffusers.<class_name>.__call__` (num_inference_steps 28,
    guidance_scale 3.5, max_sequence_length 512, ...), by parameter name; {} for an unknown class."""
    return {k: v for k, v in (call_signature(class_name) or {}).items() if v is not NOT_LITERAL}


@lru_cache(maxsize=64)
def call_signature(class_name: str) -> dict[str, object] | None:
    """`diffusers.<class_name>.__call__`'s parameters in order, each with its default as a
    literal (None where it has none, NOT_LITERAL where the source spells it otherwise), read from
    diffusers' source (its own or a base class's, by name); None when diffusers has no such class."""
    call = _call_node(class_name)
    if call is None:
        return None if _class_node(_diffusers_sources(), class_name) is None else {}
    return _signature(call.args)


def _diffusers_sources() -> tuple[tuple[Path, str], ...]:
    spec = importlib.util.find_spec("diffusers")
    if spec is None or spec.origin is None:
        return ()
    return _pipeline_sources(str(Path(spec.origin).parent / "pipelines"))


@lru_cache(maxsize=64)
def _call_node(class_name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """`diffusers.<class_name>.__call__` as parsed from diffusers' source (its own or a base
    class's, by name); None when the class or its `__call__` is not found."""
    sources = _diffusers_sources()
    seen: set[str] = set()
    name: str | None = class_name
    while name is not None and name not in seen:
        seen.add(name)
        node = _class_node(sources, name)
        if node is None:
            return None
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__call__":
                return item
        bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id.endswith("Pipeline")]
        name = bases[0] if bases else None
    return None


def _all_args(args: ast.arguments) -> list[ast.arg]:
    return [*args.posonlyargs, *args.args, *args.kwonlyargs]


def _signature(args: ast.arguments) -> dict[str, object]:
    positional = [*args.posonlyargs, *args.args]
    # Defaults align with the last positional parameters; keyword-only ones carry their own.
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = [*zip(positional, defaults), *zip(args.kwonlyargs, args.kw_defaults)]
    out: dict[str, object] = {}
    for arg, default in pairs:
        if arg.arg == "self":
            continue
        try:
            out[arg.arg] = None if default is None else ast.literal_eval(default)
        except ValueError:
            out[arg.arg] = NOT_LITERAL
    return out


@lru_cache(maxsize=1)
def _pipeline_sources(pipelines_dir: str) -> tuple[tuple[Path, str], ...]:
    """Every module of diffusers/pipelines as text (read once per process)."""
    return tuple(
        (path, path.read_text(encoding="utf-8", errors="replace"))
        for path in sorted(Path(pipelines_dir).rglob("*.py"))
    )


def _class_node(sources: tuple[tuple[Path, str], ...], name: str) -> ast.ClassDef | None:
    """The class `name` defined at the top of a pipelines module: found as text, then only that
    module parsed (parsing all of them takes seconds)."""
    pattern = re.compile(rf"^class {re.escape(name)}\(", re.MULTILINE)
    for _path, text in sources:
        if pattern.search(text) is None:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
    return None
