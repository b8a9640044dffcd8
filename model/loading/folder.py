"""A model folder on disk, read without torch: the diffusers layout, each component's config.json
and the list of its safetensors files.

`model.memory` plans from these alone, so `ditfleet plan` reads a model without loading torch;
`model.loading.weights` and `model.loading.loader` load the tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from ditfleet.model.diffusers_pipeline.index import (
    NATIVE_PIPELINES,
    DiffusersPipelineError,
    check_runnable,
    is_native,
    read_index,
)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

log = logging.getLogger(__name__)
_ignored_seen: set[tuple[str, str]] = set()


class WeightsError(ValueError):
    """A component directory that cannot be loaded as-is; the message says what to do."""


def read_config(component_dir: Path) -> dict:
    path = Path(component_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(
            f"{path}: missing. A diffusers-layout component needs a config.json next to its weights."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e}).") from e


def drop_ignored_keys(d: dict, ignored: Mapping[str, str], kind: str) -> dict:
    """`d` without the keys that published configs carry but that do not change the computation.

    `ignored` maps each such key to why it is harmless. Each (kind, key) is logged once per
    process at debug level, the way diffusers drops config keys its classes do not take.
    """
    out = {}
    for k, v in d.items():
        if k in ignored:
            if (kind, k) not in _ignored_seen:
                _ignored_seen.add((kind, k))
                log.debug("%s config: ignoring %r (%s)", kind, k, ignored[k])
            continue
        out[k] = v
    return out


def safetensors_files(component_dir: Path) -> list[Path]:
    """The safetensors files of one component, in shard order; refuses pickle checkpoints."""
    component_dir = Path(component_dir)
    if not component_dir.is_dir():
        raise WeightsError(f"{component_dir}: not a directory. Expected a diffusers-layout component folder.")
    index = sorted(component_dir.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (component_dir / n).is_file()]
        if missing:
            raise WeightsError(
                f"{index[0]}: lists shards that are not there: {missing}. Re-download the component."
            )
        return [component_dir / n for n in names]
    files = sorted(component_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in component_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise WeightsError(
            f"{component_dir}: only pickle checkpoints found ({', '.join(pickles)}). Pickle files can run code when "
            "loaded, so they are refused: convert them to safetensors (e.g. save_pretrained(safe_serialization=True))."
        )
    raise WeightsError(f"{component_dir}: no *.safetensors weights found.")


# The model path that names the bundled tiny model, and where its weights are.
TINY_MODEL = "tiny"
TINY_MODEL_DIR = Path(__file__).parents[1] / "tiny" / "weights"  # model/tiny/weights
REQUIRED_COMPONENTS = ("transformer", "vae", "scheduler")
# model_index.json pipeline classes whose transformer/vae/scheduler this loader computes exactly.
SUPPORTED_PIPELINES = NATIVE_PIPELINES


def resolve_model_dir(path: str | Path) -> Path:
    """ "tiny" -> the bundled model; else a local directory in the diffusers layout. A folder
    whose model_index.json names a pipeline without a native family is checked as diffusers
    would run it (model.diffusers_pipeline.index), not for the native components."""
    root = TINY_MODEL_DIR if str(path) == TINY_MODEL else Path(path)
    if not root.is_dir():
        raise WeightsError(f"model path {root}: not a directory. Give a diffusers-layout folder or 'tiny'.")
    if check_model_index(root) not in (None, *SUPPORTED_PIPELINES):
        return root
    missing = [c for c in REQUIRED_COMPONENTS if not (root / c).is_dir()]
    if missing:
        raise WeightsError(
            f"model path {root}: missing {missing}. A model folder needs transformer/, vae/ and scheduler/ "
            "(the diffusers layout)."
        )
    return root


def check_model_index(root: Path) -> str | None:
    """The pipeline class the folder's model_index.json names (None without one: a hand-assembled
    folder may lack it). A class without a native family must be one diffusers can run here as
    text-to-image (refused up front otherwise, naming what to do)."""
    try:
        info = read_index(root)
    except DiffusersPipelineError as e:
        raise WeightsError(str(e)) from None
    if info is None:
        return None
    if not is_native(info.class_name):
        try:
            check_runnable(info)
        except DiffusersPipelineError as e:
            raise WeightsError(str(e)) from None
    return info.class_name


def check_native_index(root: Path) -> None:
    """Refuse a checkpoint of another pipeline where only the native loader can read it."""
    cls = check_model_index(root)
    if cls is not None and cls not in SUPPORTED_PIPELINES:
        raise WeightsError(
            f"{root / 'model_index.json'}: _class_name is {cls!r}; the native loader runs "
            f"{list(SUPPORTED_PIPELINES)} checkpoints. Load it through its model family (model.family)."
        )


def text_encoder_kind(te_dir: Path) -> str:
    """ "tiny" or "qwen2.5-vl" from text_encoder/config.json; any other model is refused by name."""
    config = read_config(te_dir)
    archs = config.get("architectures") or [""]
    cls = config.get("_class_name") or archs[0]
    if cls == "TinyTextEncoder":
        return "tiny"
    if cls.startswith("Qwen2_5_VL"):
        return "qwen2.5-vl"
    raise WeightsError(
        f"{te_dir / 'config.json'}: text encoder {cls!r} is not Qwen2.5-VL (Qwen-Image's encoder). "
        "Point the model path at a Qwen-Image checkpoint."
    )
