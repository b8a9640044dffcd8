"""The JSON objects at an output's root (`_job.json`, `_SUCCESS`), read with an error that names
the object when it is not one."""

from __future__ import annotations

import json
from typing import Any

from ditfleet.workers.storage import ObjectNotFound, ObjectStore


def read_json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    """The JSON object at `key`, or None when there is none. Raises ValueError naming the key
    when it is not JSON (a damaged or foreign file)."""
    try:
        data = store.get(key)
    except ObjectNotFound:
        return None
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{store.uri(key)} is not valid JSON ({e}); was it written by ditfleet?") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{store.uri(key)} does not hold a JSON object; was it written by ditfleet?")
    return doc
