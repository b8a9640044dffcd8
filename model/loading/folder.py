"""A model folder on disk, read without torch: the diffusers layout, each component's config.json
the list of its safetensors files and its content fingerprint (`model_revision`, which every
family's loader records, the native one and diffusers' alike).

`model.memory` plans from these alone, so `ditfleet plan` reads a model without loading torch;
`model.loading.weights` and `model.qwen_image.loader` load the tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

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


def read_model_index(root: str | os.PathLike) -> dict | None:
    """A model folder's model_index.json (what pipeline class it is), None when it has none; a
    file that is not a JSON object is refused naming it."""
    path = Path(root) / "model_index.json"
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e}).") from e
    if not isinstance(index, dict):
        raise WeightsError(f"{path}: not a JSON object (a model_index.json names its `_class_name`).")
    return index


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
# Its edit variant (recipes/tiny/train_edit.py): its own DiT and text encoder, the tiny model's VAE.
TINY_EDIT_MODEL = "tiny-edit"
TINY_EDIT_MODEL_DIR = Path(__file__).parents[1] / "tiny" / "edit_weights"  # model/tiny/edit_weights
# Every model that ships with ditfleet: the name a job's model.path gives -> its folder.
BUNDLED_MODELS = MappingProxyType({TINY_MODEL: TINY_MODEL_DIR, TINY_EDIT_MODEL: TINY_EDIT_MODEL_DIR})
REQUIRED_COMPONENTS = ("transformer", "vae", "scheduler")


def model_dir_layout(path: str | Path) -> Path:
    """ "tiny" or "tiny-edit" -> the bundled model; else a local directory in the diffusers layout
    (which family its model_index.json names is model.family.resolve_model_dir's check)."""
    root = BUNDLED_MODELS.get(str(path)) or Path(path)
    if not root.is_dir():
        raise WeightsError(
            f"model path {root}: not a directory. Give a diffusers-layout folder or one of {sorted(BUNDLED_MODELS)}."
        )
    missing = [c for c in REQUIRED_COMPONENTS if not (root / c).is_dir()]
    if missing:
        raise WeightsError(
            f"model path {root}: missing {missing}. A model folder needs transformer/, vae/ and scheduler/ "
            "(the diffusers layout)."
        )
    return root


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


def model_revision(root: Path) -> str:
    """A cheap content fingerprint: configs plus each safetensors file's size and header.

    The header lists every tensor's name, dtype, shape and byte offsets, so any change in
    architecture or any re-save is seen, without hashing tens of gigabytes.
    """
    h = hashlib.sha256()
    for comp in sorted(p for p in root.iterdir() if p.is_dir()):
        for cfg in sorted(comp.glob("*.json")):
            h.update(f"{comp.name}/{cfg.name}".encode())
            h.update(cfg.read_bytes())
        for st in sorted(comp.glob("*.safetensors")):
            with st.open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f"{comp.name}/{st.name}:{st.stat().st_size}".encode())
                h.update(f.read(n))
    return h.hexdigest()[:16]
