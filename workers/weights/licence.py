"""A model's licence: from the job (`model.license`) or its model card, and whether it permits
commercial use.

The model card is the folder's `README.md`, as the Hugging Face Hub ships it: a YAML front matter
block between `---` lines at the top, whose `license:` is an SPDX-like id ("apache-2.0") or
"other" with the id in `license_name:` ("flux-1-dev-non-commercial-license"). The card is data
from wherever the model came from, so it is read defensively: at most CARD_MAX_BYTES, the front
matter through yaml's safe loader, and a value that is not one short id is "not known" with the
reason, never an error that stops a job that does not ask about licences.

The driver resolves the licence once per job (`validate`, `plan`, `run`), records it in
`_job.json`, hands it to every actor (each image's provenance metadata and the manifests'
`model_license` column) and, under `model.require_commercial_licence: true`, refuses a licence
that is not known to permit commercial use before any work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ditfleet.workers.storage import ObjectNotFound, S3Config, StoreError, open_store

MODEL_CARD = "README.md"
# The front matter is at the top of the card; a card is read no further than this, and a front
# matter block longer than FRONT_MATTER_MAX_BYTES is refused unread (the Hub's own cards hold a
# few hundred bytes of it).
CARD_MAX_BYTES = 256 * 1024
FRONT_MATTER_MAX_BYTES = 64 * 1024
# A licence id as the Hub writes them: lower case letters, digits and . _ + -, at most 100.
LICENCE_ID = re.compile(r"[a-z0-9][a-z0-9._+-]{0,99}")
JOB_SOURCE = "model.license in the job"


@dataclass(frozen=True)
class KnownLicence:
    commercial_use: bool  # the weights may be run to make images for a commercial purpose
    note: str  # what it is and which models ship under it


# The licence ids ditfleet knows, as model cards write them. Only these decide
# `model.require_commercial_licence`; any other id (or none) is refused under it, with what to do.
# A licence that permits commercial use only under conditions the job cannot check (revenue caps)
# counts as not permitting it. Sources: each model's card on the Hugging Face Hub.
KNOWN_LICENCES: dict[str, KnownLicence] = {
    "apache-2.0": KnownLicence(
        True,
        "Apache License 2.0 (Qwen-Image, Qwen-Image-2512, Qwen-Image-Lightning, FLUX.1-schnell, "
        "FLUX.2-klein-4B, Z-Image-Turbo)",
    ),
    "mit": KnownLicence(True, "MIT License"),
    "bsd-3-clause": KnownLicence(True, "BSD 3-Clause License"),
    "cc-by-4.0": KnownLicence(True, "Creative Commons Attribution 4.0"),
    "openrail++": KnownLicence(True, "CreativeML Open RAIL++-M (SDXL): commercial use with use restrictions"),
    "nvidia-open-model-agreement": KnownLicence(
        True, "NVIDIA Open Model Agreement: commercial use permitted (nvidia/Qwen-Image-Flash)"
    ),
    "nvidia-open-model-license": KnownLicence(True, "NVIDIA Open Model License: commercial use permitted"),
    "flux-1-dev-non-commercial-license": KnownLicence(
        False,
        "FLUX.1 [dev] Non-Commercial License (FLUX.1-dev): a commercial licence is sold by Black Forest Labs",
    ),
    "flux-dev-non-commercial-license": KnownLicence(
        False,
        "FLUX [dev] Non-Commercial License (FLUX.2-dev): a commercial licence is sold by Black Forest Labs",
    ),
    "flux-non-commercial-license": KnownLicence(
        False,
        "FLUX Non-Commercial License (FLUX.2-klein-9B): a commercial licence is sold by Black Forest Labs",
    ),
    "qwen-research": KnownLicence(False, "Qwen Research License: research and non-commercial use only"),
    "tongyi-qianwen-research": KnownLicence(
        False, "Tongyi Qianwen Research License: non-commercial use only"
    ),
    "stabilityai-ai-community": KnownLicence(
        False,
        "Stability AI Community License (SD3.5): commercial use only under USD 1M annual revenue, "
        "which a job cannot check; above it an Enterprise licence from Stability AI",
    ),
    "cc-by-nc-4.0": KnownLicence(False, "Creative Commons Attribution-NonCommercial 4.0"),
    "cc-by-nc-sa-4.0": KnownLicence(False, "Creative Commons Attribution-NonCommercial-ShareAlike 4.0"),
    "cc-by-nc-nd-4.0": KnownLicence(False, "Creative Commons Attribution-NonCommercial-NoDerivatives 4.0"),
}


class LicenceRefused(ValueError):
    """`model.require_commercial_licence: true` and a licence not known to permit commercial use."""


@dataclass(frozen=True)
class ModelLicence:
    """The licence a job's images are made under. `id` None: not known, `source` says why."""

    id: str | None
    source: str  # where the id came from, or why there is none

    @property
    def known(self) -> KnownLicence | None:
        return KNOWN_LICENCES.get(self.id) if self.id is not None else None

    @property
    def commercial_use(self) -> bool | None:
        """True / False from the table; None for an id it does not hold, or no id."""
        known = self.known
        return known.commercial_use if known is not None else None

    def to_dict(self) -> dict[str, Any]:
        """What `_job.json` records."""
        return {"id": self.id, "source": self.source, "commercial_use": self.commercial_use}

    def describe(self) -> str:
        """One line for `plan`: "apache-2.0 (from .../README.md front matter; commercial use: yes)"."""
        use = {True: "yes", False: "no", None: "not known"}[self.commercial_use]
        if self.id is None:
            return f"not known ({self.source}); commercial use: not known"
        return f"{self.id} (from {self.source}; commercial use: {use})"

    def check_commercial(self) -> None:
        """Raise LicenceRefused unless the licence is known to permit commercial use."""
        known = self.known
        head = "model.require_commercial_licence: true, but"
        if known is not None and known.commercial_use:
            return
        if known is not None:
            raise LicenceRefused(
                f"{head} the model's licence {self.id!r} (from {self.source}) does not permit commercial "
                f"use: {known.note}. Use a model whose licence does (e.g. Qwen/Qwen-Image, apache-2.0), "
                "or set require_commercial_licence: false if the images are not for commercial use"
            )
        if self.id is None:
            raise LicenceRefused(
                f"{head} the model's licence is not known ({self.source}). Read the model's licence and, if "
                "it permits commercial use, give its id as model.license (e.g. model.license: apache-2.0); "
                f"the ids ditfleet knows: {', '.join(sorted(KNOWN_LICENCES))}"
            )
        raise LicenceRefused(
            f"{head} the model's licence {self.id!r} (from {self.source}) is not one ditfleet knows to permit "
            f"commercial use (known: {', '.join(sorted(KNOWN_LICENCES))}). Read the licence: if it permits "
            "commercial use, add it to KNOWN_LICENCES in ditfleet/workers/weights/licence.py; if not, use "
            "another model or set require_commercial_licence: false"
        )


def check_licence_id(value: str) -> str:
    """A licence id as the job gives it (`model.license`), lower-cased; ValueError if it is not one."""
    text = value.strip().lower()
    if not LICENCE_ID.fullmatch(text):
        raise ValueError(
            f"{value!r} is not a licence id: give it as model cards write it (letters, digits, . _ + -, "
            "at most 100), e.g. apache-2.0 or flux-1-dev-non-commercial-license"
        )
    return text


def card_licence(card: bytes, where: str) -> ModelLicence:
    """The licence a model card's front matter names. `where`: the card, for the source line."""
    text = card[:CARD_MAX_BYTES].decode("utf-8", errors="replace").removeprefix("\ufeff")
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return ModelLicence(None, f"{where} has no front matter (no '---' on its first line)")
    end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() in ("---", "...")), None)
    if end is None:
        return ModelLicence(None, f"{where}: its front matter has no closing '---'")
    block = "\n".join(lines[1:end])
    if len(block.encode("utf-8")) > FRONT_MATTER_MAX_BYTES:
        return ModelLicence(
            None, f"{where}: its front matter is over {FRONT_MATTER_MAX_BYTES} bytes; not read"
        )
    try:
        # safe_load builds plain values only (no tags that run code); an alias is a shared
        # reference, not a copy, so alias bombs stay small.
        front = yaml.safe_load(block)
    except (yaml.YAMLError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return ModelLicence(None, f"{where}: its front matter is not valid YAML ({first})")
    if not isinstance(front, dict):
        return ModelLicence(None, f"{where}: its front matter is not a mapping of keys")
    if "license" not in front:
        return ModelLicence(None, f"{where}: its front matter has no license key")
    value = front["license"]
    key = "license"
    if isinstance(value, str) and value.strip().lower() == "other" and front.get("license_name") is not None:
        value, key = front["license_name"], "license_name"
    if not isinstance(value, str):
        return ModelLicence(
            None, f"{where}: {key} in its front matter is not one licence id (got {_short(value)})"
        )
    try:
        return ModelLicence(check_licence_id(value), f"{where} front matter")
    except ValueError:
        return ModelLicence(None, f"{where}: {key} {_short(value)} in its front matter is not a licence id")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_model_licence(model_path: str, local_dir: Path | None, s3: S3Config | None = None) -> ModelLicence:
    """The licence the model card of `model_path` names: `local_dir`/README.md for a local model
    (the bundled one too), the store's README.md for s3:// (a store this machine cannot read: not
    known, with the store's error). An hf:// card is not read at plan time (nothing is fetched to
    plan a job): give model.license."""
    if local_dir is not None:
        card = local_dir / MODEL_CARD
        if not card.is_file():
            return ModelLicence(None, f"{card} not found")
        with card.open("rb") as f:
            return card_licence(f.read(CARD_MAX_BYTES), str(card))
    if model_path.startswith("s3://"):
        store = open_store(model_path, s3)
        try:
            data = store.get(MODEL_CARD)
        except ObjectNotFound:
            return ModelLicence(None, f"{store.uri(MODEL_CARD)} not found")
        except StoreError as e:  # no access from here: not known, and said why (refused under require)
            return ModelLicence(None, f"{store.uri(MODEL_CARD)} could not be read ({e})")
        return card_licence(data, store.uri(MODEL_CARD))
    return ModelLicence(None, f"the model card of {model_path} is not read to plan a job; give model.license")
