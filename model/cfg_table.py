"""The measured CFG table: serial against batched CFG per resolution bucket and batch, as the
node self-test's `cfg_modes` stage measured it on one GPU kind (`cfg_table.json` in its --out
folder). `sampling.cfg_mode: auto` picks by it where it has the bucket (model.generation.pipeline.
cfg_batched_for); without a table, or for a bucket it lacks, the fixed rule stays.

Torch-free: the job spec reads the file once (the knob's `parse`), names the file and key of
anything wrong in it, and hands the table to every actor as plain data.

The file:

    {"format": 1, "device": "NVIDIA H100 80GB HBM3",
     "entries": [{"size": "1024x1024", "batch": 1, "serial_ms": 251.2, "batched_ms": 246.0}, ...]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CFG_TABLE_FORMAT = 1
CFG_TABLE_FILE = "cfg_table.json"  # what the self-test's cfg_modes stage writes into its --out folder
SPEC_KEY = "sampling.cfg_table"
_ENTRY_KEYS = ("size", "batch", "serial_ms", "batched_ms")


class CfgTableError(ValueError):
    """A CFG table that cannot be read: the message names the file and the key."""


@dataclass(frozen=True)
class CfgEntry:
    """One measurement: ms per CFG step of `batch` images of height x width, each way."""

    height: int
    width: int
    batch: int
    serial_ms: float
    batched_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": f"{self.width}x{self.height}",
            "batch": self.batch,
            "serial_ms": self.serial_ms,
            "batched_ms": self.batched_ms,
        }


@dataclass(frozen=True)
class CfgTable:
    """Serial against batched CFG per bucket and batch, measured on `device`."""

    device: str
    entries: tuple[CfgEntry, ...]

    def batched(self, tokens: int, batch: int, tokens_of: Callable[[int, int], int]) -> bool | None:
        """Whether a CFG step of `batch` images of `tokens` image tokens runs faster batched, by
        the measurement of the same bucket (`tokens_of(height, width)`: the family's image tokens
        of a size) at the largest measured batch not above `batch` (the smallest measured one
        below it all); None: the bucket was not measured."""
        same = [e for e in self.entries if tokens_of(e.height, e.width) == tokens]
        if not same:
            return None
        below = [e for e in same if e.batch <= batch]
        entry = max(below, key=lambda e: e.batch) if below else min(same, key=lambda e: e.batch)
        return entry.batched_ms < entry.serial_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CFG_TABLE_FORMAT,
            "device": self.device,
            "entries": [e.to_dict() for e in self.entries],
        }


def cfg_table_from_dict(raw: Any, where: str) -> CfgTable:
    """A table from its JSON form; CfgTableError names `where` and the key of anything wrong."""
    if not isinstance(raw, dict):
        raise CfgTableError(
            f"{where}: expected a JSON object with format, device, entries; got {type(raw).__name__}"
        )
    unknown = sorted(set(raw) - {"format", "device", "entries"})
    if unknown:
        raise CfgTableError(f"{where}: unknown keys {unknown}; a CFG table has format, device, entries")
    if raw.get("format") != CFG_TABLE_FORMAT:
        raise CfgTableError(
            f"{where}: format: expected {CFG_TABLE_FORMAT}, got {raw.get('format')!r}; "
            "write it again with the self-test (--extra cfg_modes)"
        )
    device = raw.get("device")
    if not isinstance(device, str) or not device:
        raise CfgTableError(f"{where}: device: expected the GPU's name (a string), got {device!r}")
    rows = raw.get("entries")
    if not isinstance(rows, list) or not rows:
        raise CfgTableError(f"{where}: entries: expected a non-empty list, got {rows!r}")
    entries = tuple(_entry(row, f"{where}: entries[{i}]") for i, row in enumerate(rows))
    seen: dict[tuple[int, int, int], int] = {}
    for i, e in enumerate(entries):
        key = (e.height, e.width, e.batch)
        if key in seen:
            raise CfgTableError(
                f"{where}: entries[{i}]: size {e.width}x{e.height} batch {e.batch} is measured twice "
                f"(entries[{seen[key]}] too); keep one"
            )
        seen[key] = i
    return CfgTable(device, entries)


def _entry(row: Any, where: str) -> CfgEntry:
    if not isinstance(row, dict):
        raise CfgTableError(f"{where}: expected an object with {list(_ENTRY_KEYS)}, got {row!r}")
    missing = [k for k in _ENTRY_KEYS if k not in row]
    unknown = sorted(set(row) - set(_ENTRY_KEYS))
    if missing or unknown:
        raise CfgTableError(
            f"{where}: missing keys {missing}, unknown keys {unknown}; an entry has {list(_ENTRY_KEYS)}"
        )
    size = row["size"]
    parts = size.split("x") if isinstance(size, str) else []
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CfgTableError(f"{where}.size: expected 'WxH' in pixels, got {size!r}")
    width, height = int(parts[0]), int(parts[1])
    batch = row["batch"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CfgTableError(f"{where}.batch: expected a whole number >= 1, got {batch!r}")
    times = []
    for key in ("serial_ms", "batched_ms"):
        v = row[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CfgTableError(f"{where}.{key}: expected milliseconds > 0, got {v!r}")
        times.append(float(v))
    return CfgEntry(height, width, batch, times[0], times[1])


def read_cfg_table(path: str | Path) -> CfgTable:
    """The table in a `cfg_table.json` file (local: the job spec reads it where it is planned)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CfgTableError(
            f"{SPEC_KEY}: cannot read {path} ({e.strerror or e}); the self-test writes it with --extra cfg_modes"
        ) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CfgTableError(f"{path}: not valid JSON ({e})") from None
    return cfg_table_from_dict(raw, str(path))


def parse_cfg_table(value: Any) -> CfgTable | None:
    """The knob's value: None, a path to a cfg_table.json, a table's JSON form (what the resolved
    spec writes back) or a CfgTable -> the table or None. The job spec calls it once."""
    if value is None or isinstance(value, CfgTable):
        return value
    if isinstance(value, (str, Path)):
        return read_cfg_table(value)
    if isinstance(value, dict):
        return cfg_table_from_dict(value, SPEC_KEY)
    raise CfgTableError(f"{SPEC_KEY}: expected a path to a cfg_table.json, got {type(value).__name__}")


def cfg_table_value(table: CfgTable | None) -> dict[str, Any] | None:
    """The knob as the resolved job file and the fingerprint write it: the table itself, so that
    where the file lay does not matter and `parse_cfg_table` reads it back as it was."""
    return None if table is None else table.to_dict()
