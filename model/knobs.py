"""The knob machinery: a knob's default, type, bounds and description live on its dataclass field.

Each layer owns a frozen dataclass of the knobs it uses (`PipelineSettings` in model.settings;
`CompileConfig`, `ModelPlacement`, `DispatchConfig`, ... above) and writes every knob with
`setting(...)`. The job spec's pydantic sections are derived from these fields
(jobs/spec/derive.py), so the file format, its validation and its documentation cannot drift from
what the code uses, and a new knob is one field plus the code that reads it.

Standard library only: every layer's config imports it, the planning side (the job spec,
`ditfleet validate`) included.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Callable
from typing import Any, Literal

# The metadata keys `setting` understands; bounds as pydantic (and `operator`) name them.
BOUNDS = ("ge", "gt", "le", "lt")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    description: str,
    default_factory: Any = dataclasses.MISSING,
    fingerprint: Literal["always", "when_set", "when"] | None = None,
    fingerprint_key: str | None = None,
    fingerprint_when: Callable[[Any], bool] | None = None,
    parse: Callable[[Any], Any] | None = None,
    dump: Callable[[Any], Any] | None = None,
    **bounds: float,
) -> Any:
    """A dataclass field that is a user-facing knob.

    description: what the knob does, as the job file's documentation says it.
    bounds: ge / gt / le / lt, checked by the spec (and by `check_settings`).
    fingerprint: the knob changes the stored bytes of an image, so the plan's fingerprint records
      it (jobs.spec.derive.fingerprint_entries), under `fingerprint_key` or its name: "always", or
      "when_set": only when it differs from its default, so that outputs planned before the knob
      existed keep their fingerprint; "when": whenever `fingerprint_when(settings)` holds for the
      settings object that owns the knob (a knob that matters only beside another one).
    parse, dump: for a knob whose value is a typed object: what the job file's value becomes (the
      spec calls it, once) and the JSON form written back (the resolved spec, the fingerprint).
    """
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"setting(): unknown bounds {sorted(unknown)}; use {BOUNDS}")
    metadata: dict[str, Any] = {"description": description, **bounds}
    if (fingerprint == "when") != (fingerprint_when is not None):
        raise TypeError('setting(): fingerprint="when" goes with fingerprint_when, and only it')
    if fingerprint is not None:
        metadata.update(
            fingerprint=fingerprint, fingerprint_key=fingerprint_key, fingerprint_when=fingerprint_when
        )
    if parse is not None:
        metadata.update(parse=parse, dump=dump)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def bounded(default: Any, **bounds: float) -> Any:
    """A dataclass field that is no user-facing knob but has limits: ge / gt / le / lt, checked
    by `check_settings` like a knob's (a None value passes: "no limit")."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown or not bounds:
        raise TypeError(f"bounded(): give bounds among {BOUNDS}, got {sorted(bounds)}")
    return dataclasses.field(default=default, metadata=bounds)


def settings_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The knobs of a settings dataclass (fields written with `setting`), by name, in order."""
    return {f.name: f for f in dataclasses.fields(cls) if "description" in f.metadata}


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_SAYS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def check_settings(obj: Any) -> None:
    """Check every field of a settings dataclass against its Literal type and bounds (a knob's
    are the ones the job spec checks; `bounded` gives a plain field some), so that code building
    the dataclass directly gets the same limits. The one check: a config adds by hand only what
    relates two fields.

    A float knob is finite, bounded or not: no knob means anything by infinity (a knob without a
    limit says so with null), and a NaN passes every comparison (a gate's `min: .nan` would fail
    every image) and is not JSON (`_job.json`). The job spec refuses the same (jobs.spec.sections)."""
    hints = typing.get_type_hints(type(obj))
    name = type(obj).__name__
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = literal_values(hints[f.name])
        # By type too: 1 is not True, and True is not 1.
        if allowed is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"{name}.{f.name} must be one of {allowed}, got {value!r}")
        if "description" in f.metadata and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value!r}")
        if value is None or not any(b in f.metadata for b in BOUNDS):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value!r}")
        for bound in BOUNDS:
            if bound in f.metadata and not getattr(operator, bound)(value, f.metadata[bound]):
                raise ValueError(f"{name}.{f.name} must be {_SAYS[bound]} {f.metadata[bound]}, got {value!r}")


def literal_values(tp: Any) -> tuple | None:
    """The values a Literal type (or a union holding Literals) allows; None if it is not one."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    args = typing.get_args(tp)
    if args and any(typing.get_origin(a) is Literal for a in args):
        values: list = []
        for a in args:
            if typing.get_origin(a) is Literal:
                values += typing.get_args(a)
            elif a is type(None):
                values.append(None)
            elif a is bool:
                values += [True, False]
            else:
                return None  # a Literal next to a free type: not a closed set
        return tuple(values)
    return None
