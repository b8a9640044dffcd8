"""Spec fields derived from the lower layers' settings dataclasses.

A knob is defined once, on the dataclass of the layer that uses it (`model.knobs.setting`:
default, type, bounds, description). A section of the job file is an ordinary pydantic class
whose knob fields say which knob they show, under their own key:

    class ModelSpec(Section):
        path: str = Field(default=TINY_MODEL, description="...")  # a field of the spec's own
        cache_dir: str = knob(WorkerConfig, "model_cache_dir")     # a knob under another key
        device: Device = knob(ModelPlacement, "device")            # a knob under its own name

`knob` makes the pydantic field from the dataclass field (default, bounds, description, the
knob's parser); the annotation is written out so that type checkers see the spec's types, and
tests/unit/jobs/test_settings_once.py checks it is the dataclass field's. Going back down,
`settings_from(PipelineSettings, spec.model, spec.sampling)` builds the dataclass from whichever
sections show its knobs, so no knob's value is copied by hand in either direction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from pydantic import BaseModel, Field, PlainSerializer, PlainValidator

from ditfleet.model.knobs import BOUNDS, field_default, settings_fields

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Knob:
    """The spec field that shows `source`'s knob `name` (kept in the pydantic field's metadata)."""

    source: type
    name: str

    def field(self) -> dataclasses.Field:
        try:
            return settings_fields(self.source)[self.name]
        except KeyError:
            raise TypeError(
                f"{self.source.__name__}.{self.name} is not a setting (write it with model.knobs.setting)"
            ) from None


def knob(source: type, name: str) -> Any:
    """The pydantic field that shows `source`'s knob `name`: its default, bounds and description,
    and for a typed value its own parser and JSON form."""
    k = Knob(source, name)
    f = k.field()
    info = Field(
        field_default(f),
        description=f.metadata["description"],
        **{b: f.metadata[b] for b in BOUNDS if b in f.metadata},
    )
    info.metadata.append(k)
    if "parse" in f.metadata:
        info.metadata += [PlainValidator(f.metadata["parse"]), PlainSerializer(f.metadata["dump"])]
    return info


def section_knobs(section_cls: type[BaseModel]) -> dict[str, Knob]:
    """The knobs a section shows, by spec key ({} for a section with none)."""
    return {key: m for key, f in section_cls.model_fields.items() for m in f.metadata if isinstance(m, Knob)}


def fingerprint_entries(config: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The knobs of `config` and of the settings dataclasses it holds that are marked `fingerprint`
    (model.knobs.setting), as the plan's fingerprint records them: by key, in their JSON form."""
    out = {} if out is None else out
    for f in dataclasses.fields(config):
        value, mode = getattr(config, f.name), f.metadata.get("fingerprint")
        if mode is None and dataclasses.is_dataclass(value):
            fingerprint_entries(value, out)
        elif (
            mode == "always"
            or (mode == "when_set" and value != field_default(f))
            or (mode == "when" and f.metadata["fingerprint_when"](config))
        ):
            key = f.metadata["fingerprint_key"] or f.name
            if key in out:
                raise TypeError(
                    f"{type(config).__name__}.{f.name}: another knob enters the fingerprint as {key!r}"
                )
            out[key] = f.metadata["dump"](value) if "dump" in f.metadata else value
    return out


def settings_from(source: type[T], *sections: BaseModel, **given: Any) -> T:
    """`source` built from the knobs the sections show, plus `given` (fields the spec resolves
    itself, such as absolute paths)."""
    values = {
        k.name: getattr(sec, key)
        for sec in sections
        for key, k in section_knobs(type(sec)).items()
        if k.source is source
    }
    return source(**{**values, **given})
