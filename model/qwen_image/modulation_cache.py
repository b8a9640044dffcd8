"""Modulation caching for serial classifier-free guidance.

Each block's modulation (`img_mod`, `txt_mod`: Linear(SiLU(temb))) depends only on the timestep
embedding and frozen weights, never on the prompt. With serial CFG the conditional and the
unconditional pass of one step compute it twice; this module lets the second pass reuse the first.

Key: the identity of the timestep tensor that the pipeline passes to both passes of a step (held
weakly, so a freed tensor whose id is reused can never hit), its in-place version counter, the same
for the extra timestep conditioning, and the activation dtype and device. Tensors made under
`torch.inference_mode()` carry no version counter; for them the key holds their values instead
(one tiny device-to-host copy per forward, not per block).

Modes:
- "off":   compute every time.
- "cfg":   one slot per block; a miss computes and stores, a hit returns and empties the slot
           (consume once); a different key overwrites the slot.
- "auto":  "table" where the activations are on a GPU, "cfg" elsewhere (decided per forward from
           the key's device: model.settings.resolve_modulation_cache).
- "table": per block, every step's modulation is kept for as long as the timestep tensor lives.
           The pipeline reuses one timestep tensor per (schedule, step) across requests, so after
           the first request of a bucket no request computes any modulation. Memory is the price:
           num_layers x steps x 2 x 6 x dim values (about 220 MB for Qwen-Image, 50 steps, bf16).

No caching at all when grad is enabled, in training mode, while torch.compile traces, or during
CUDA graph capture: outputs there must come from the real computation.
"""

from __future__ import annotations

import typing
import weakref
from dataclasses import dataclass, field

import torch

from ditfleet.model.settings import ModulationCache as ModulationCacheMode
from ditfleet.model.settings import resolve_modulation_cache

MODES = typing.get_args(ModulationCacheMode)


def _tensor_id(t: torch.Tensor | None) -> tuple:
    """(weakref, version, values) identifying a tensor's current content cheaply."""
    if t is None:
        return (None, None, None)
    if t.is_inference():
        # No version counter: fall back to the values (a few scalars).
        return (weakref.ref(t), None, tuple(t.detach().flatten().tolist()))
    return (weakref.ref(t), t._version, None)


@dataclass(frozen=True, eq=False)
class ModulationKey:
    timestep: tuple
    extra: tuple
    dtype: torch.dtype
    device: torch.device

    def matches(self, other: ModulationKey | None) -> bool:
        if other is None:
            return False
        for mine, theirs in ((self.timestep, other.timestep), (self.extra, other.extra)):
            ref_a, ver_a, val_a = mine
            ref_b, ver_b, val_b = theirs
            if (ref_a is None) != (ref_b is None):
                return False
            if ref_a is not None:
                a, b = ref_a(), ref_b()
                if a is None or a is not b:
                    return False
            if ver_a != ver_b or val_a != val_b:
                return False
        return self.dtype == other.dtype and self.device == other.device


def caching_allowed(module: torch.nn.Module) -> bool:
    if torch.is_grad_enabled() or module.training or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def make_key(
    module: torch.nn.Module,
    timestep: torch.Tensor,
    extra: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> ModulationKey | None:
    """The cache key for one forward, or None when caching must be bypassed."""
    if not caching_allowed(module):
        return None
    return ModulationKey(_tensor_id(timestep), _tensor_id(extra), dtype, torch.device(device))


Modulation = tuple[torch.Tensor, torch.Tensor]  # (img_mod (B, 6D), txt_mod (B, 6D))


@dataclass
class ModulationSlot:
    """One block's single-entry, consume-once cache ("cfg" mode)."""

    key: ModulationKey | None = None
    value: Modulation | None = None

    def take(self, key: ModulationKey) -> Modulation | None:
        if self.value is not None and key.matches(self.key):
            value = self.value
            self.clear()
            return value
        return None

    def put(self, key: ModulationKey, value: Modulation) -> None:
        self.key, self.value = key, value

    def clear(self) -> None:
        self.key, self.value = None, None


@dataclass
class ModulationTable:
    """Every step's modulation for every block, keyed like the slot ("table" mode).

    Entries live as long as their timestep tensor: a weakref finalizer drops them, so the table
    only ever holds the schedules the pipeline keeps alive.
    """

    entries: dict[int, tuple[ModulationKey, dict[int, Modulation]]] = field(default_factory=dict)

    def get(self, key: ModulationKey, block: int) -> Modulation | None:
        ref = key.timestep[0]
        obj = ref() if ref is not None else None
        hit = self.entries.get(id(obj)) if obj is not None else None
        if hit is None or not key.matches(hit[0]):
            return None
        return hit[1].get(block)

    def put(self, key: ModulationKey, block: int, value: Modulation) -> None:
        ref = key.timestep[0]
        obj = ref() if ref is not None else None
        if obj is None:
            return
        slot_id = id(obj)
        hit = self.entries.get(slot_id)
        if hit is None or not key.matches(hit[0]):
            self.entries[slot_id] = (key, {})
            weakref.finalize(obj, self.entries.pop, slot_id, None)
        self.entries[slot_id][1][block] = value

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for _, blocks in self.entries.values()
            for m in blocks.values()
            for t in m
        )

    def clear(self) -> None:
        self.entries.clear()


class ModulationCache:
    """The transformer's cache: a mode, one slot per block, and the table."""

    def __init__(self, num_blocks: int, mode: str = "cfg") -> None:
        self.slots = [ModulationSlot() for _ in range(num_blocks)]
        self.table = ModulationTable()
        self.mode = "off"
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"modulation_cache must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.clear()

    def clear(self) -> None:
        for s in self.slots:
            s.clear()
        self.table.clear()

    def mode_on(self, device_type: str) -> str:
        """The mode that runs on `device_type` ("auto" resolved)."""
        return resolve_modulation_cache(self.mode, device_type)

    def lookup(self, key: ModulationKey | None, block: int) -> Modulation | None:
        if key is None:
            self.slots[block].clear()
            return None
        mode = self.mode_on(key.device.type)
        if mode == "off":
            return None
        if mode == "table":
            return self.table.get(key, block)
        return self.slots[block].take(key)

    def store(self, key: ModulationKey | None, block: int, value: Modulation) -> None:
        if key is None:
            return
        mode = self.mode_on(key.device.type)
        if mode == "off":
            return
        if mode == "table":
            self.table.put(key, block, value)
        else:
            self.slots[block].put(key, value)

    def nbytes(self) -> int:
        slots = sum(t.numel() * t.element_size() for s in self.slots if s.value is not None for t in s.value)
        return slots + self.table.nbytes()
