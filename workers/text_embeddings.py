"""Prompt embeddings on an actor: where the text encoder lives, and a cache of what it made.

`PlacedTextEncoder` stands where the pipeline's text encoder stood (same `encode(prompts,
max_length) -> (embeds, mask)` contract), so warm-up, the batch generator and the pipeline use
it unchanged.

- Placement. `gpu`: the encoder sits next to the DiT for the whole job (about 16.6 GB for
  Qwen2.5-VL-7B in bf16). `cpu`: it is loaded on the CPU and encodes there; its weights never
  take GPU memory. `offload`: it waits on the CPU and comes onto the GPU only to encode a
  shard's prompts up front (`prefetch`), then leaves; when it cannot sit next to the DiT, the
  DiT waits in host memory meanwhile.
- Cache. Every prompt is encoded on its own and its embeddings (T real tokens, D) are kept in
  host memory, least recently used dropped first, up to a byte budget: the job's constant
  negative prompt and repeated prompts are encoded once per actor. Encoding one prompt at a
  time also makes a prompt's embedding independent of the other prompts of its batch, so a
  cache hit gives exactly what a miss would have, and every placement gives the same images
  on the same device (an encoder on the CPU rounds differently from one on a GPU, though).
- Ahead. `encode_ahead` fills the cache with the next shard's first batch from the actor's
  prefetch thread (workers.prefetch) while the current shard generates; one prompt is encoded
  at a time under a lock, so the generator's own encodes wait at most one prompt for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ditfleet.model.settings import MAX_SEQUENCE_LENGTH
from ditfleet.workers.contract import PLACEMENTS

log = logging.getLogger(__name__)

# Room left next to the text encoder's weights for its activations and the allocator.
_ENCODE_HEADROOM = 2 * 2**30

Key = tuple[str, int]  # (prompt, max_length)


class EmbeddingCache:
    """Prompt embeddings (T, D) in host memory, bounded by bytes, least recently used out first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"embedding cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[Key, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Key) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Key, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return  # larger than the whole budget: not kept
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._items),
            "bytes": self.bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }


def _move(encoder: Any, device: torch.device) -> None:
    move = getattr(encoder, "to", None)
    if move is None:
        raise TypeError(
            f"{type(encoder).__name__} has no .to(device): it cannot be moved for model.text_encoder: offload; "
            "use gpu or cpu"
        )
    move(device)


class PlacedTextEncoder:
    """A text encoder with a placement and an embedding cache; see the module docstring.

    encoder: anything with `encode(prompts, max_length) -> (embeds (B, L, D), mask (B, L))`,
      already on its home device (the GPU for `gpu`, the CPU otherwise).
    device: the actor's compute device (where `offload` brings the encoder to encode).
    transformer: the DiT, moved to host memory during an offloaded encode when both do not fit;
      swap_dit: True/False forces that decision, None decides from the free GPU memory.
    """

    def __init__(
        self,
        encoder: Any,
        placement: str,
        device: str | torch.device,
        cache_bytes: int,
        transformer: torch.nn.Module | None = None,
        swap_dit: bool | None = None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"text encoder placement must be one of {PLACEMENTS}, got {placement!r}")
        self.encoder, self.placement = encoder, placement
        self.device = torch.device(device)
        self.cache = EmbeddingCache(cache_bytes)
        self.transformer, self.swap_dit = transformer, swap_dit
        self.hidden_size = encoder.hidden_size
        self.encoder_calls = 0  # prompts the wrapped encoder actually encoded
        self.dit_swaps = 0
        self._pinned: dict[Key, torch.Tensor] = {}  # the current shard's prefetched prompts
        # One encode at a time: the generator's (and its encode-next thread's) and encode_ahead's.
        self._lock = threading.RLock()

    # -- the TextEncoder contract --------------------------------------------------------------

    def encode(
        self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds (B, L, D), mask (B, L) long) on the CPU; L = the longest prompt in tokens."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("encode: got no prompts")
        # An offloaded encoder encodes on the CPU outside prefetch (warm-up): not kept, so that
        # no request ever gets an embedding from another device than the one prefetch uses.
        keep = self.placement != "offload"
        rows = [self._embedding(p, max_length, keep) for p in prompts]
        longest = max(r.shape[0] for r in rows)
        embeds = rows[0].new_zeros(len(rows), longest, rows[0].shape[-1])  # (B, L, D)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            embeds[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = 1
        return embeds, mask

    def count_tokens(self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH) -> list[int]:
        """Each prompt's embedding length: the encoder's tokenizer when it has a counter, else the
        cached (or prefetched) embeddings, encoding what is missing."""
        count = getattr(self.encoder, "count_tokens", None)
        if count is not None:
            # Under the lock: a fast tokenizer called from two threads at once (the prefetch's
            # and an encode's) can fail with "Already borrowed" (it sets its truncation per call).
            with self._lock:
                return list(count(list(prompts), max_length))
        keep = self.placement != "offload"
        return [self._embedding(p, max_length, keep).shape[0] for p in prompts]

    # -- offload ---------------------------------------------------------------------------------

    def prefetch(self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH) -> int:
        """Encode the prompts a shard will ask for, up front, and keep them until `release`.

        With `offload` the encoder comes onto the device for this and leaves afterwards; other
        placements simply fill the cache. Returns the number of prompts encoded (misses).
        """
        todo = [p for p in dict.fromkeys(prompts) if (p, max_length) not in self._pinned]
        hits = {(p, max_length): v for p in todo if (v := self.cache.get((p, max_length))) is not None}
        self._pinned.update(hits)
        misses = [p for p in todo if (p, max_length) not in hits]
        if not misses:
            return 0
        offload = self.placement == "offload"
        swap = offload and self._needs_swap()
        if swap:
            assert self.transformer is not None
            self.transformer.to("cpu")
            _empty_cache(self.device)
            self.dit_swaps += 1
        try:
            if offload:
                _move(self.encoder, self.device)
            for p in misses:
                self._pinned[(p, max_length)] = self._embedding(p, max_length, keep=True, force=True)
        finally:
            if offload:
                _move(self.encoder, torch.device("cpu"))
                _empty_cache(self.device)
            if swap:
                assert self.transformer is not None
                self.transformer.to(self.device)
        return len(misses)

    def encode_ahead(self, prompts: Sequence[str], max_length: int = MAX_SEQUENCE_LENGTH) -> int:
        """Encode into the cache, from another thread while the device works, the prompts a
        coming shard starts with; returns how many were encoded (misses). Nothing for `offload`:
        its encoder waits on the host and would take device memory from the running DiT; it
        encodes a shard's prompts in `prefetch` at the shard's start."""
        if self.placement == "offload":
            return 0
        before = self.encoder_calls
        for p in dict.fromkeys(prompts):
            self._embedding(p, max_length, keep=True)
        return self.encoder_calls - before

    def release(self) -> None:
        """The shard is done: its prefetched prompts are only kept as the cache's budget allows."""
        self._pinned.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "encoder_calls": self.encoder_calls,
            "dit_swaps": self.dit_swaps,
            **self.cache.stats(),
        }

    # -- helpers ---------------------------------------------------------------------------------

    def _embedding(self, prompt: str, max_length: int, keep: bool, force: bool = False) -> torch.Tensor:
        with self._lock:
            return self._embedding_locked(prompt, max_length, keep, force)

    def _embedding_locked(self, prompt: str, max_length: int, keep: bool, force: bool) -> torch.Tensor:
        key = (prompt, max_length)
        if not force:
            pinned = self._pinned.get(key)
            if pinned is not None:
                return pinned
            cached = self.cache.get(key)
            if cached is not None:
                return cached
        embeds, mask = self.encoder.encode([prompt], max_length)  # (1, T, D), (1, T)
        self.encoder_calls += 1
        value = embeds[0][mask[0].bool()].detach().to("cpu")  # (T real tokens, D)
        if keep:
            self.cache.put(key, value)
        return value

    def _needs_swap(self) -> bool:
        if self.transformer is None:
            return False
        if self.swap_dit is not None:
            return self.swap_dit
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        # Blocks the caching allocator holds but no tensor uses are free for the encoder too.
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        need = _module_bytes(self.encoder) + _ENCODE_HEADROOM
        return free < need


def _module_bytes(encoder: Any) -> int:
    module = encoder if isinstance(encoder, torch.nn.Module) else getattr(encoder, "model", None)
    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
