"""docs/job-file.md, the reference of every job-file key, written from the spec's own fields (the
sections and the knobs they show), so it cannot drift from what `load_spec` accepts.

    python -m ditfleet.jobs.spec.reference > docs/job-file.md     # `make docs` does this

tests/unit/jobs/test_job_file_reference.py fails when the file is not what this writes.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .job import JobSpec

REFERENCE_PATH = "docs/job-file.md"

_HEAD = """\
# The job file

Every key a job file (YAML or JSON) may hold: its type, its default, its bounds and what it is for.
Written by `make docs` (`python -m ditfleet.jobs.spec.reference`) from the spec's own fields, which
take their defaults, bounds and descriptions from the settings of the layer that uses them; a test
fails when this page is not what that writes. An unknown key is an error naming the line, with
"did you mean"; `ditfleet validate job.yaml` checks a file and its input rows without a cluster.
The example job, [jobs/examples/tiny.yaml](../jobs/examples/tiny.yaml), sets the keys most jobs set.

Relative paths start at the directory `ditfleet` runs in. `null` is YAML's empty value.
"""


def _type_name(annotation: Any) -> str:
    """A field's type as a job file writes it: int, float, 'a' | 'b', list of ..., null."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(repr(m.value) for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    if dataclasses.is_dataclass(annotation):
        return "see meaning"  # a knob with its own parser (a preset name or a mapping)
    if isinstance(annotation, type):
        return {"str": "string", "bool": "true \\| false"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return "(its keys' defaults)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if value is PydanticUndefined:
        return "required"
    return repr(value) if isinstance(value, str) else str(value)


_BOUND_SIGNS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _bounds(info: FieldInfo) -> str:
    found = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge | annotated_types.Gt | annotated_types.Le | annotated_types.Lt):
            for name, sign in _BOUND_SIGNS:
                if hasattr(m, name):
                    v = getattr(m, name)
                    found.append(f"{sign} {v:,}" if isinstance(v, int) else f"{sign} {v:g}")
    return ", ".join(found)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds (itself, or in a list or an Optional), else None."""
    candidates = (annotation, *typing.get_args(annotation))
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def reference_keys(model: type[BaseModel] = JobSpec, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key a job file may hold, dotted (`workers.batch_size`), with its field; a section's
    keys follow the section's own."""
    for key, info in model.model_fields.items():
        yield prefix + key, info
        inner = _section(info.annotation)
        if inner is not None:
            yield from reference_keys(inner, f"{prefix}{key}{'[].' if _is_list(info.annotation) else '.'}")


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


def job_file_reference() -> str:
    """The text of docs/job-file.md."""
    lines = [_HEAD]
    for key, info in JobSpec.model_fields.items():
        lines += [f"## `{key}`", "", _one_line(info.description), ""]
        inner = _section(info.annotation)
        if inner is None:
            lines += [f"Type {_type_name(info.annotation)}, default {_default(info)}.", ""]
            continue
        lines += ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
        for dotted, field in reference_keys(inner, f"{key}."):
            row = (f"`{dotted}`", _type_name(field.annotation), _default(field), _bounds(field))
            lines.append("| " + " | ".join((*row, _one_line(field.description))) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(job_file_reference(), end="")
