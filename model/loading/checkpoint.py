"""A component's safetensors checkpoint as the hub ships it: one file, or shards plus an index.

Everything here reads only the files' headers (a few kilobytes each), so a broken checkpoint (a
missing or truncated shard, an index that names absent files or tensors, tensors of the wrong
shape) is refused by name before any weight is read or any device memory is touched. Loading then
streams shard by shard, tensor by tensor: host memory beyond the model itself stays at about one
tensor.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ditfleet.model.loading.weights import WeightsError, check_state_matches, safetensors_files

# diffusers / transformers shard names: <stem>-00002-of-00009.safetensors
_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit

_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets of the data in `file`
    end: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Tensor names, dtypes and shapes of one safetensors file; checks the file is complete."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: truncated ({size} bytes, not even a header). Re-download this file.")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise WeightsError(
                f"{path}: truncated or not a safetensors file (header says {n} bytes, file has {size}). "
                "Re-download this file."
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header ({e}). Re-download this file.") from e
    header.pop("__metadata__", None)
    entries, data_end = {}, 0
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        shape = tuple(int(s) for s in meta["shape"])
        dtype = _TORCH_DTYPES.get(meta["dtype"])
        if dtype is not None and end - start != math.prod(shape) * dtype.itemsize:
            raise WeightsError(f"{path}: tensor {name!r} has inconsistent offsets. Re-download this file.")
        data_end = max(data_end, end)
        entries[name] = TensorEntry(path, meta["dtype"], shape, 8 + n + start, 8 + n + end)
    if 8 + n + data_end > size:
        raise WeightsError(
            f"{path}: truncated: its header describes {8 + n + data_end} bytes but the file has {size}. "
            "Re-download this file."
        )
    return entries


def _missing_numbered_shards(files: list[Path]) -> list[str]:
    """Shard names that a `-0000i-of-0000n` series implies but the folder lacks."""
    series: dict[tuple[str, int], set[int]] = {}
    for f in files:
        m = _SHARD_NAME.match(f.name)
        if m:
            series.setdefault((m["stem"], int(m["n"])), set()).add(int(m["i"]))
    missing = []
    for (stem, n), have in series.items():
        missing += [f"{stem}-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1) if i not in have]
    return missing


class Checkpoint:
    """The tensors of one component folder, from headers only; validated on construction."""

    def __init__(self, component_dir: Path) -> None:
        self.dir = Path(component_dir)
        self.files = safetensors_files(self.dir)  # refuses pickles; an index naming absent files
        missing = _missing_numbered_shards(self.files)
        if missing:
            raise WeightsError(
                f"{self.dir}: shards {missing} are missing (the other shards' names say they exist). "
                "Re-download the component."
            )
        self.tensors: dict[str, TensorEntry] = {}
        for f in self.files:
            for name, entry in read_header(f).items():
                if name in self.tensors:
                    raise WeightsError(f"{f}: tensor {name!r} is also in {self.tensors[name].file.name}.")
                self.tensors[name] = entry
        self._check_index()

    def _check_index(self) -> None:
        index = sorted(self.dir.glob("*.safetensors.index.json"))
        if not index:
            return
        weight_map = json.loads(index[0].read_text()).get("weight_map", {})
        wrong = [
            f"{k} -> {v}"
            for k, v in weight_map.items()
            if k not in self.tensors or self.tensors[k].file.name != v
        ]
        if wrong:
            raise WeightsError(
                f"{index[0]}: {len(wrong)} tensors are not where the index says, e.g. {wrong[:5]}. "
                "The index and the shards come from different downloads; re-download the component."
            )
        unlisted = sorted(set(self.tensors) - set(weight_map))
        if unlisted:
            raise WeightsError(f"{index[0]}: tensors in the shards but not in the index: {unlisted[:10]}.")

    @property
    def largest_file_bytes(self) -> int:
        return max(f.stat().st_size for f in self.files)

    def check_matches(self, module: torch.nn.Module, where: str) -> None:
        """Every key of `module` present with its shape, and nothing else (names the keys)."""
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        check_state_matches(expected, {k: tuple(e.shape) for k, e in self.tensors.items()}, where)

    def iter_shards(self) -> Iterator[tuple[Path, Iterator[tuple[str, torch.Tensor]]]]:
        """(file, an iterator of its tensors on the CPU), one file at a time.

        Tensors are read one by one with plain reads at their header offsets rather than through
        a memory map: mapped pages count as the process's resident memory until unmapped, so a
        mapped shard would sit in RSS whole while its tensors are copied out.
        """
        by_file: dict[Path, list[tuple[str, TensorEntry]]] = {}
        for name, entry in self.tensors.items():
            by_file.setdefault(entry.file, []).append((name, entry))
        for f in self.files:
            entries = sorted(by_file.get(f, []), key=lambda kv: kv[1].start)
            yield f, _read_tensors(f, entries)


def _read_tensors(path: Path, entries: list[tuple[str, TensorEntry]]) -> Iterator[tuple[str, torch.Tensor]]:
    with path.open("rb", buffering=0) as fh:
        for name, e in entries:
            dtype = _TORCH_DTYPES.get(e.dtype)
            if dtype is None:
                raise WeightsError(
                    f"{path}: tensor {name!r} has dtype {e.dtype}, which ditfleet cannot load."
                )
            buf = bytearray(e.end - e.start)
            fh.seek(e.start)
            if fh.readinto(buf) != len(buf):
                raise WeightsError(f"{path}: truncated while reading {name!r}. Re-download this file.")
            flat = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            yield name, flat.view(dtype).reshape(e.shape)


class TensorTransform(Protocol):
    """What load_streaming may apply to the module and to each tensor (see load_streaming)."""

    def prepare(self, module: torch.nn.Module) -> None: ...

    def __call__(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...


def load_streaming(
    module: torch.nn.Module,
    checkpoint: Checkpoint,
    where: str,
    dtype: torch.dtype,
    device: str | torch.device,
    transform: TensorTransform | None = None,
) -> torch.nn.Module:
    """Fill a meta-device `module` from `checkpoint`, one shard at a time, strictly.

    Tensors are read one at a time and cast/moved at once; each shard's are assigned together.
    Host memory beyond the model itself stays at about one tensor (on an accelerator the model
    itself is not in host memory at all).

    transform: reshapes the module after its keys are checked (`prepare`) and turns each cast
    tensor into the entries to assign (model.qwen_image.fp8.Fp8Quantizer: a weight into FP8 and its scales),
    so that a converted model never exists in the load dtype as a whole.
    """
    checkpoint.check_matches(module, where)
    if transform is not None:
        transform.prepare(module)
    for _, tensors in checkpoint.iter_shards():
        cast = {}
        for k, v in tensors:
            t = v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device=device)
            del v  # the read buffer goes as soon as its cast copy exists
            if transform is None:
                cast[k] = t
            else:
                cast.update(transform(k, t))
            del t
        module.load_state_dict(cast, strict=False, assign=True)
        del cast
    left = [k for k, v in module.state_dict().items() if v.is_meta]
    if left:  # check_matches makes this unreachable; kept so a half-filled model can never escape
        raise WeightsError(f"{where}: tensors not filled by the checkpoint: {left[:10]}.")
    return module
