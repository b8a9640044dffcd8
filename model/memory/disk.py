"""What a checkpoint holds on disk, read from its safetensors headers alone (no tensor is loaded)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from ditfleet.model.loading.folder import WeightsError, safetensors_files

_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@dataclass(frozen=True)
class CheckpointSize:
    """What a component's safetensors headers say: tensors, parameters, bytes on disk, dtypes."""

    files: int
    tensors: int
    params: int
    bytes: int
    dtypes: tuple[str, ...]


def checkpoint_size(component_dir: str | Path) -> CheckpointSize:
    """Read only the safetensors headers (8-byte length + JSON) of one component folder."""
    files = safetensors_files(Path(component_dir))
    tensors = params = nbytes = 0
    dtypes: set[str] = set()
    for f in files:
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise WeightsError(
                    f"{f}: shorter than a safetensors header; the file is truncated. Re-download it."
                )
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise WeightsError(f"{f}: header length {n} is not plausible; not a safetensors file.")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsError(f"{f}: unreadable safetensors header ({e}).") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(int(d) for d in info["shape"])
            tensors += 1
            params += count
            nbytes += count * _SAFETENSORS_BYTES.get(info["dtype"], 0)
            dtypes.add(info["dtype"])
    return CheckpointSize(len(files), tensors, params, nbytes, tuple(sorted(dtypes)))
