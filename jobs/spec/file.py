"""Reading a job file: YAML (or JSON) text -> a validated `JobSpec`, or one `SpecError` that
lists every problem as 'file:line: key.path: what is wrong'.

Pydantic reports where a problem is as a key path; the YAML's own node marks give each path its
line, so a user is sent to the line to fix, and an unknown key comes with the keys allowed there.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from .job import JobSpec
from .problems import SpecError, validated


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file (YAML, or JSON for *.json). Raises SpecError listing every
    problem as 'file:line: key.path: what is wrong'."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{name}: job file not found; check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{name}: cannot read the job file ({e})") from e
    return parse_spec(text, name)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one
    and silently drops the first (a whole section, say)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{key!r} appears twice in one mapping (first on line {first.start_mark.line + 1}); "
                    "merge the two, YAML would silently drop the first",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]], name: str) -> dict[str, Any]:
    twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    if twice:
        raise SpecError(f"{name}: {', '.join(map(repr, twice))} appears twice in one object; merge the two")
    return dict(pairs)


def parse_spec(text: str, name: str = "<job>") -> JobSpec:
    """Validate job text; `name` is the file name used in error messages."""
    try:
        if name.endswith(".json"):
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique_pairs(pairs, name))
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except json.JSONDecodeError as e:
        raise SpecError(f"{name}:{e.lineno}: not valid JSON: {e.msg}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{name}{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from e
    if not isinstance(data, dict):
        raise SpecError(
            f"{name}: a job file must be a mapping with at least 'input' and 'output' sections, "
            f"got {type(data).__name__}"
        )
    return validated(JobSpec, data, name, _key_lines(text))


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every mapping key path in a YAML (or JSON) document, for error messages."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    out: dict[tuple[str, ...], int] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = (*prefix, str(key.value))
                out[path] = key.start_mark.line + 1
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                path = (*prefix, str(i))
                out[path] = item.start_mark.line + 1
                walk(item, path)

    walk(root, ())
    return out
