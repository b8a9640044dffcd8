"""Every knob is defined once: on the settings dataclass of the layer that uses it.

The job spec's sections are derived from those dataclasses (jobs/spec/derive.py); these tests walk
the spec and the dataclasses and fail when a tier says something else about a knob: another
default, type, bound or description, a knob the job file cannot set, or a function of a lower
layer whose parameter of the same name defaults to something else.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import typing

import pytest
from pydantic import BaseModel

from ditfleet.jobs.spec import JobSpec
from ditfleet.jobs.spec.derive import section_knobs
from ditfleet.model.knobs import BOUNDS, field_default, settings_fields
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH_LIMIT


def _sections(model: type[BaseModel] = JobSpec, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section of the job file (nested ones too), by key path."""
    out: dict[str, type[BaseModel]] = {}
    for name, f in model.model_fields.items():
        tp = f.annotation
        for candidate in (tp, *typing.get_args(tp)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                out[prefix + name] = candidate
                out.update(_sections(candidate, f"{prefix}{name}."))
    return out


def _knobs() -> list[tuple[str, str, object]]:
    """(section path, spec key, Knob) for every knob the job file shows."""
    return [(path, key, k) for path, cls in _sections().items() for key, k in section_knobs(cls).items()]


def _settings_classes() -> set[type]:
    """Every settings dataclass reachable from what the spec hands the driver and the workers."""
    spec = JobSpec.model_validate({"input": {"path": "/in.parquet"}, "output": {"uri": "/out"}})
    seen: set[type] = set()

    def walk(obj: object) -> None:
        if not dataclasses.is_dataclass(obj) or type(obj) in seen:
            return
        seen.add(type(obj))
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name))

    walk(spec.to_worker_config())
    walk(spec.to_driver_config())
    return {cls for cls in seen if settings_fields(cls)}


KNOBS = _knobs()


def test_the_spec_shows_knobs_of_several_layers():
    sources = {k.source.__name__ for _, _, k in KNOBS}
    assert {"PipelineSettings", "ModelPlacement", "CompileConfig", "DispatchConfig", "RowConfig"} <= sources


@pytest.mark.parametrize(("path", "key", "knob"), KNOBS, ids=[f"{p}.{k}" for p, k, _ in KNOBS])
def test_a_spec_field_says_what_its_dataclass_field_says(path, key, knob):
    spec_field = _sections()[path].model_fields[key]
    f = knob.field()
    assert spec_field.get_default(call_default_factory=True) == field_default(f), f"{path}.{key}: default"
    assert spec_field.description == f.metadata["description"], f"{path}.{key}: description"
    assert spec_field.annotation == typing.get_type_hints(knob.source)[knob.name], f"{path}.{key}: type"
    bounds = {b: getattr(m, b) for m in spec_field.metadata for b in BOUNDS if hasattr(m, b)}
    assert bounds == {b: f.metadata[b] for b in BOUNDS if b in f.metadata}, f"{path}.{key}: bounds"


def test_every_knob_below_the_spec_can_be_set_in_the_job_file():
    shown = {(k.source, k.name) for _, _, k in KNOBS}
    missing = [
        f"{cls.__name__}.{name}"
        for cls in _settings_classes()
        for name in settings_fields(cls)
        if (cls, name) not in shown
    ]
    assert not missing, f"knobs no job-file key shows: {missing}"


def test_a_job_file_without_a_key_gives_every_layer_its_own_default():
    spec = JobSpec.model_validate({"input": {"path": "/in.parquet"}, "output": {"uri": "/out"}})
    built: dict[type, object] = {}

    def walk(obj: object) -> None:
        if dataclasses.is_dataclass(obj) and type(obj) not in built:
            built[type(obj)] = obj
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(spec.to_worker_config())
    walk(spec.to_driver_config())
    for cls in _settings_classes():
        for name, f in settings_fields(cls).items():
            assert getattr(built[cls], name) == field_default(f), f"{cls.__name__}.{name}"


# Parameters that take a knob under another name.
_ALIASES = {"max_length": "max_sequence_length"}
# Layers whose functions take knobs as parameters (the driver and jobs take the dataclasses).
_LAYERS = ("ditfleet.model", "ditfleet.compile", "ditfleet.workers")


def _functions():
    for layer in _LAYERS:
        package = importlib.import_module(layer)
        for info in pkgutil.walk_packages(package.__path__, layer + "."):
            if ".tiny." in info.name and "text_encoder" not in info.name:
                continue  # the bundled model's recipe code, not the serving path
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if getattr(obj, "__module__", None) != info.name:
                    continue
                if inspect.isfunction(obj):
                    yield info.name, obj.__qualname__, obj
                elif inspect.isclass(obj):
                    for member in vars(obj).values():
                        if inspect.isfunction(member):
                            yield info.name, member.__qualname__, member


def test_functions_below_the_spec_default_a_knob_as_its_definition_does():
    # Knobs that reach the model: the pipeline's, the compile config's and the batch size.
    from ditfleet.compile.config import CompileConfig
    from ditfleet.model.settings import PipelineSettings

    defaults = {
        name: field_default(f)
        for cls in (PipelineSettings, CompileConfig)
        for name, f in settings_fields(cls).items()
    }
    wrong = []
    for module, name, fn in _functions():
        for p in inspect.signature(fn).parameters.values():
            knob = _ALIASES.get(p.name, p.name)
            if knob in defaults and p.default is not inspect.Parameter.empty and p.default is not None:
                if p.default != defaults[knob]:
                    wrong.append(f"{module}.{name}({p.name}={p.default!r}), defined as {defaults[knob]!r}")
    assert not wrong, wrong


def test_the_prompt_length_limit_is_the_largest_prompt_length_bucket():
    from ditfleet.compile.buckets import PROMPT_LENGTH_BUCKETS

    assert MAX_SEQUENCE_LENGTH in PROMPT_LENGTH_BUCKETS
    assert MAX_SEQUENCE_LENGTH_LIMIT == PROMPT_LENGTH_BUCKETS[-1]
