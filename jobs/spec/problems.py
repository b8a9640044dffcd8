"""A job's validation problems as one `SpecError`: 'file:line: key.path: what is wrong', an
unknown key with the keys allowed there (and the close one it was probably meant to be).

Shared by the job file reader (jobs.spec.file) and `JobSpec.with_changes`."""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class SpecError(ValueError):
    """A job file that cannot be used; the message names the file, line and key."""


def validated(
    model: type[M],
    data: dict[str, Any],
    name: str = "<job>",
    lines: dict[tuple[str, ...], int] | None = None,
    what: str = "the job file",
) -> M:
    """`model` validated from `data` (a parsed file, or a spec with changes made in code), or one
    SpecError listing every problem; `lines` maps key paths to the file's lines, for messages."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = [_describe(model, dict(err), name, lines or {}) for err in e.errors()]
        head = f"{name}: {len(problems)} problem{'s' if len(problems) != 1 else ''} in {what}:"
        raise SpecError("\n".join([head, *(f"  {p}" for p in problems)])) from None


def _describe(
    root: type[BaseModel], err: dict[str, Any], name: str, lines: dict[tuple[str, ...], int]
) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc) or "(top level)"
    line = next((lines[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in lines), None)
    where = f"{name}:{line}" if line else name
    kind = err["type"]
    if kind == "extra_forbidden":
        keys = _allowed_keys(root, loc[:-1])
        close = difflib.get_close_matches(loc[-1], keys, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{where}: {key}: unknown key{hint}; allowed here: {', '.join(keys)}"
    if kind == "missing":
        return f"{where}: {key}: required, missing"
    message = str(err["msg"]).removeprefix("Value error, ")
    given = err.get("input")
    shown = "" if isinstance(given, dict) or "got " in message else f" (got {given!r})"
    if message.startswith((f"{key}:", f"{key}.")):  # a checker that names its own key, deeper
        return f"{where}: {message}{shown}"
    return f"{where}: {key}: {message}{shown}"


def _allowed_keys(root: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    model = root
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
