"""Spec sections derived from the lower layers' settings dataclasses.

A knob is defined once, on the dataclass of the layer that uses it (`model.settings.setting`:
default, type, bounds, description). A section of the job file names which knobs it shows and
under which key (`knob(CompileConfig, "vae")`); its pydantic field is made from the dataclass
field, with `typing.get_type_hints` so that a Literal type becomes validation. Going back down,
`settings_from(PipelineSettings, spec.model, spec.sampling)` builds the dataclass from whichever
sections show its knobs, so no knob is copied by hand in either direction.

    ModelSpec = section("ModelSpec", "...", {
        "path": (str, Field(...)),                          # a field of the spec's own
        "cache_dir": knob(WorkerConfig, "model_cache_dir"),  # a knob shown under another key
        **knobs(PipelineSettings, exclude=("cfg_mode",)),     # every knob of a dataclass
    })
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, Field, PlainSerializer, PlainValidator, create_model

from ditfleet.model.settings import BOUNDS, field_default, settings_fields


@dataclasses.dataclass(frozen=True)
class Knob:
    """A spec field that shows `source`'s knob `name`; `overrides` replace some of its Field
    arguments where the job file needs a different form (none do today)."""

    source: type
    name: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def field(self) -> dataclasses.Field:
        try:
            return settings_fields(self.source)[self.name]
        except KeyError:
            raise TypeError(
                f"{self.source.__name__}.{self.name} is not a setting (write it with model.settings.setting)"
            ) from None

    def annotation(self) -> Any:
        return typing.get_type_hints(self.source)[self.name]

    def default(self) -> Any:
        return field_default(self.field())

    def pydantic(self) -> tuple[Any, Any]:
        f = self.field()
        kwargs: dict[str, Any] = {b: f.metadata[b] for b in BOUNDS if b in f.metadata}
        kwargs["description"] = f.metadata["description"]
        kwargs.update(self.overrides)
        annotation = self.annotation()
        if "parse" in f.metadata:  # a typed value: the knob's own parser reads the job file's form
            annotation = Annotated[
                annotation, PlainValidator(f.metadata["parse"]), PlainSerializer(f.metadata["dump"])
            ]
        return annotation, Field(self.default(), **kwargs)


def knob(source: type, name: str, **overrides: Any) -> Knob:
    return Knob(source, name, overrides)


def knobs(source: type, exclude: Iterable[str] = ()) -> dict[str, Knob]:
    """Every knob of `source` under its own name, but those in `exclude` (shown elsewhere)."""
    skip = set(exclude)
    return {name: Knob(source, name) for name in settings_fields(source) if name not in skip}


def section(
    name: str,
    doc: str | None,
    fields: Mapping[str, Knob | tuple[Any, Any]],
    base: type[BaseModel],
    validators: Mapping[str, Any] | None = None,
) -> Any:
    """A pydantic model with `fields` in the order given (the order the job file's error
    messages list the allowed keys in): knobs made from their dataclass field, the others as
    `(type, Field(...))`. `validators`: field_validator / model_validator objects by name."""
    definitions = {key: f.pydantic() if isinstance(f, Knob) else f for key, f in fields.items()}
    caller = sys._getframe(1).f_globals.get("__name__", __name__)
    model = create_model(
        name,
        __base__=base,
        __doc__=inspect.cleandoc(doc) if doc else None,
        __module__=caller,
        __validators__=dict(validators or {}),
        **definitions,
    )
    type.__setattr__(model, "__knobs__", {k: f for k, f in fields.items() if isinstance(f, Knob)})
    return model


def section_knobs(section_cls: type) -> dict[str, Knob]:
    """The knobs a section shows, by spec key ({} for a section with none)."""
    return dict(getattr(section_cls, "__knobs__", {}))


def knob_values(source: type, *sections: BaseModel) -> dict[str, Any]:
    """The values the sections give `source`'s knobs, by the dataclass field's name."""
    out: dict[str, Any] = {}
    for sec in sections:
        for key, k in section_knobs(type(sec)).items():
            if k.source is source:
                out[k.name] = getattr(sec, key)
    return out


def fingerprint_entries(config: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The knobs of `config` and of the settings dataclasses it holds that are marked `fingerprint`
    (model.settings.setting), as the plan's fingerprint records them: by key, in their JSON form."""
    out = {} if out is None else out
    for f in dataclasses.fields(config):
        value, mode = getattr(config, f.name), f.metadata.get("fingerprint")
        if mode is None and dataclasses.is_dataclass(value):
            fingerprint_entries(value, out)
        elif mode == "always" or (mode == "when_set" and value != field_default(f)):
            key = f.metadata["fingerprint_key"] or f.name
            if key in out:
                raise TypeError(
                    f"{type(config).__name__}.{f.name}: another knob enters the fingerprint as {key!r}"
                )
            out[key] = f.metadata["dump"](value) if "dump" in f.metadata else value
    return out


def settings_from(source: type, *sections: BaseModel, **given: Any) -> Any:
    """`source` built from the knobs the sections show, plus `given` (fields the spec resolves
    itself, such as absolute paths)."""
    return source(**{**knob_values(source, *sections), **given})
