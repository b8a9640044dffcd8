"""Joint attention over [image, text] without a dense mask on the hot path.

The DiT attends over one joint sequence per sample. It is laid out image first, then text, so
that a sample's real tokens are always a prefix: N image tokens, then its own text tokens, then
padding up to the batch's longest prompt. Attention is order-free over keys (RoPE is applied
before), so this is the same function as the reference's [text, image] order.

Three ways to run it, decided once per forward (`TextPadding.build`) and used by every block:
- no padding in the batch: one unmasked SDPA call (flash kernels on CUDA);
- padding ("split", the default): one unmasked SDPA per run of consecutive samples that share a
  text length, each on a prefix view of q/k/v (no copy). Padded text queries get a zero output;
  they are never attended to (masked out as keys in every block), so no real token sees them.
  Batches are formed sorted by text length, so a padded batch has few runs.
- "mask": the reference, one SDPA call with a dense boolean key mask (B, 1, 1, N + L). It rules
  out the flash kernels on CUDA. Used when asked for, and for masks that are not a prefix.

Split is the default because on CPU it is as fast as unmasked SDPA and no slower than the dense
mask (bench/dit_forward.py, `padded_attention`), and on CUDA each split call is an unmasked
SDPA, so it keeps the flash kernel; a dense mask falls back to the memory-efficient kernel.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

PADDED_ATTENTION = ("split", "mask")


@dataclass
class AttentionStats:
    """Counts over every DiT attention call (one per block per forward); plain ints, cheap.

    padded_tokens / (image_tokens + text_tokens) is the share of the DiT's token work that went
    to padding; masked_calls are the calls that carried a dense mask.
    """

    calls: int = 0
    masked_calls: int = 0  # carried a dense boolean mask
    split_calls: int = 0  # padded, run as unmasked SDPA per run of equal text lengths
    image_tokens: int = 0  # image tokens attended, summed over calls
    text_tokens: int = 0  # text tokens computed (padding included), summed over calls
    padded_tokens: int = 0  # of which padding

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """This minus an earlier `to_dict()`."""
        return {k: v - before.get(k, 0) for k, v in self.to_dict().items()}


@dataclass(frozen=True)
class TextPadding:
    """How the text of one batch is padded; built once per forward, read by every block.

    lengths: real text tokens per sample, or None when no sample is padded.
    runs: (first sample, end sample, text length) for consecutive samples sharing a length.
    dense_mask: (B, 1, 1, N + L) bool key mask, only when the mask path is used.
    """

    batch: int
    text_len: int
    image_len: int
    lengths: tuple[int, ...] | None
    runs: tuple[tuple[int, int, int], ...]
    dense_mask: torch.Tensor | None

    @property
    def padded(self) -> bool:
        return self.lengths is not None

    @property
    def padded_tokens(self) -> int:
        return 0 if self.lengths is None else sum(self.text_len - n for n in self.lengths)

    @classmethod
    def build(
        cls,
        text_mask: torch.Tensor | None,  # (B, L), 1 = real token
        batch: int,
        text_len: int,
        image_len: int,
        mode: str = "split",
    ) -> TextPadding:
        """One host read per distinct mask (`padding_facts`: once per batch, not per forward),
        none without a mask."""
        if mode not in PADDED_ATTENTION:
            raise ValueError(f"padded attention must be one of {PADDED_ATTENTION}, got {mode!r}")
        if text_mask is None:
            return cls(batch, text_len, image_len, None, (), None)
        mask = text_mask.to(torch.bool)
        prefix, counts = padding_facts(text_mask)
        if prefix and all(n == text_len for n in counts):
            return cls(batch, text_len, image_len, None, (), None)
        if mode == "mask" or not prefix:
            image = torch.ones(batch, image_len, dtype=torch.bool, device=mask.device)
            dense = torch.cat([image, mask], dim=1)[:, None, None, :]  # (B, 1, 1, N + L)
            return cls(batch, text_len, image_len, tuple(counts), (), dense)
        runs, start = [], 0
        for i in range(1, batch + 1):
            if i == batch or counts[i] != counts[start]:
                runs.append((start, i, counts[start]))
                start = i
        return cls(batch, text_len, image_len, tuple(counts), tuple(runs), None)


# The last few masks' facts: a batch's forwards (every step, both CFG passes) pass the same mask
# tensors, so each is read from the device once. Keyed by the tensor's id, checked against a weak
# reference and the tensor's version counter (an in-place change reads it again).
_FACTS: dict[int, tuple[weakref.ref, int, tuple[bool, tuple[int, ...]]]] = {}
_FACTS_KEPT = 8


def padding_facts(text_mask: torch.Tensor) -> tuple[bool, tuple[int, ...]]:
    """(whether every sample's real tokens are a prefix, the real tokens per sample) of a (B, L)
    mask: one device-to-host read per mask tensor, however many forwards use it."""
    hit = _FACTS.get(id(text_mask))
    if hit is not None and hit[0]() is text_mask and hit[1] == text_mask._version:
        return hit[2]
    mask = text_mask.to(torch.bool)
    lengths = mask.sum(dim=1)  # (B,)
    positions = torch.arange(mask.shape[1], device=mask.device)
    prefix = (mask == (positions[None, :] < lengths[:, None])).all()
    # One read for both facts: the lengths and the prefix flag side by side.
    values = torch.cat([lengths, prefix.to(lengths.dtype)[None]]).tolist()
    facts = (bool(values[-1]), tuple(int(n) for n in values[:-1]))
    if len(_FACTS) >= _FACTS_KEPT:
        _FACTS.pop(next(iter(_FACTS)))
    _FACTS[id(text_mask)] = (weakref.ref(text_mask), text_mask._version, facts)
    return facts


def joint_attention(
    q: torch.Tensor,  # (B, H, N + L, hd), image first
    k: torch.Tensor,
    v: torch.Tensor,
    padding: TextPadding,
    stats: AttentionStats | None = None,
) -> torch.Tensor:
    """(B, H, N + L, hd): attention of every real token over the real tokens of its sample."""
    if stats is not None:
        stats.calls += 1
        stats.image_tokens += padding.batch * padding.image_len
        stats.text_tokens += padding.batch * padding.text_len
        stats.padded_tokens += padding.padded_tokens
    if not padding.padded:
        return F.scaled_dot_product_attention(q, k, v)
    if padding.dense_mask is not None:
        if stats is not None:
            stats.masked_calls += 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=padding.dense_mask)
    if stats is not None:
        stats.split_calls += 1
    # The output in the fused kernels' layout, (B, S, H, hd) memory seen as (B, H, S, hd): the
    # block merges its heads as a view of it (transformer.merge_heads), no copy.
    B, H, S, hd = q.shape
    out = q.new_zeros(B, S, H, hd).transpose(1, 2)
    if len(padding.runs) == 1:  # the whole batch shares one shorter length: a trailing pad
        real = padding.image_len + padding.runs[0][2]
        out[:, :, :real] = F.scaled_dot_product_attention(q[:, :, :real], k[:, :, :real], v[:, :, :real])
        return out
    for start, end, length in padding.runs:
        real = padding.image_len + length
        out[start:end, :, :real] = F.scaled_dot_product_attention(
            q[start:end, :, :real], k[start:end, :, :real], v[start:end, :, :real]
        )
    return out
