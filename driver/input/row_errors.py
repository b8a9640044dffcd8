"""How problems with the prompt input are recorded and shown: one RowError per problem, and one
InputError that carries all of them (up to a cap) with a readable multi-line message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_VALUE_CHARS = 60


def describe_value(value: Any, limit: int = _VALUE_CHARS) -> str:
    """repr(value), cut to about `limit` characters; long strings say how long they were."""
    if value is None:
        return "null"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class RowError:
    """One problem in the input. row is 0-based within `file`; None for a file- or schema-level
    problem; column None for a file-level one. message says what is wrong, hint what to do."""

    file: str
    row: int | None
    column: str | None
    value_repr: str | None
    message: str
    hint: str = ""

    def __str__(self) -> str:
        where = self.file
        if self.row is not None:
            where += f": row {self.row}"
        if self.column is not None:
            where += f"{',' if self.row is not None else ':'} column '{self.column}'"
        text = f"{where}: {self.message}"
        if self.value_repr is not None:
            text += f" (value: {self.value_repr})"
        text += "."
        if self.hint:
            text += f" {self.hint}."
        return text


class InputError(ValueError):
    """The prompt input is not usable. `errors` holds up to the cap, `total` counts all."""

    def __init__(self, errors: Sequence[RowError], total: int | None = None) -> None:
        self.errors = tuple(errors)
        self.total = len(self.errors) if total is None else total
        super().__init__(self._message())

    def _message(self) -> str:
        n = self.total
        head = f"the prompt input has {n} problem{'s' if n != 1 else ''}"
        if n > len(self.errors):
            head += f" (the first {len(self.errors)} are shown)"
        lines = [head + ":"] + [f"  {e}" for e in self.errors]
        if n > len(self.errors):
            lines.append(f"  ... and {n - len(self.errors)} more.")
        return "\n".join(lines)


def file_error(file: str, message: str, hint: str) -> InputError:
    """An InputError about a whole file or path."""
    return InputError([RowError(file, None, None, None, message, hint)])
