"""The tiny model's text encoder: a word-level tokenizer and a 2-layer transformer.

It stands where Qwen2.5-VL stands in the real pipeline and has the same contract:
`encode(prompts, max_length) -> (embeds (B, L, D) float, mask (B, L) long)`, where L is the longest
prompt in tokens (at most `max_length`) and mask is 1 on real tokens, 0 on padding. Every sequence
starts with a <bos> token, so the empty negative prompt " " is a valid length-1 sequence. Words
outside the vocabulary map to <unk>: any text encodes, none crashes.

On disk (diffusers-ish): `text_encoder/config.json` + `text_encoder/model.safetensors`,
`tokenizer/vocab.json` (word -> id).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ditfleet.model.loading.weights import (
    WeightsError,
    assign_state_dict,
    on_meta,
    read_config,
    read_state_dict,
)
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH
from ditfleet.model.tiny.known_words import SPECIAL_TOKENS, WORD_RE

PAD, UNK, BOS = SPECIAL_TOKENS


class WordTokenizer:
    """Lower-cased alphanumeric words -> ids; ids 0, 1, 2 are <pad>, <unk>, <bos>."""

    def __init__(self, vocab: dict[str, int]) -> None:
        for i, special in enumerate((PAD, UNK, BOS)):
            if vocab.get(special) != i:
                raise ValueError(
                    f"tokenizer vocab: {special!r} must have id {i}, has {vocab.get(special)!r}."
                )
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError("tokenizer vocab: ids must be exactly 0..len(vocab)-1 with no gaps or repeats.")
        self.vocab = dict(vocab)

    @classmethod
    def from_words(cls, words: list[str]) -> WordTokenizer:
        vocab = {PAD: 0, UNK: 1, BOS: 2}
        for w in words:
            vocab.setdefault(w.lower(), len(vocab))
        return cls(vocab)

    def __len__(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str, max_length: int) -> list[int]:
        """<bos> + word ids, truncated to `max_length` tokens (>= 1)."""
        ids = [self.vocab[BOS]] + [self.vocab.get(w, self.vocab[UNK]) for w in WORD_RE.findall(text.lower())]
        return ids[:max_length]

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "vocab.json").write_text(json.dumps(self.vocab, indent=1))

    @classmethod
    def load(cls, directory: Path) -> WordTokenizer:
        path = Path(directory) / "vocab.json"
        if not path.is_file():
            raise WeightsError(
                f"{path}: missing. The tiny text encoder needs its word vocabulary next to it."
            )
        return cls(json.loads(path.read_text()))


@dataclass(frozen=True)
class TextEncoderConfig:
    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 64

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TextEncoderConfig: hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}."
            )
        if self.vocab_size < 3:
            raise ValueError(
                f"TextEncoderConfig: vocab_size {self.vocab_size} must include <pad>, <unk>, <bos>."
            )


class _Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (
            self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )  # (B, nh, L, hd) each
        attn_mask = key_mask[:, None, None, :].bool()  # (B, 1, 1, L): padding keys are invisible
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, nh, L, hd)
        x = x + self.proj(h.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TinyTextEncoder(nn.Module):
    """Token + position embeddings, `num_layers` pre-norm blocks, a final LayerNorm."""

    def __init__(self, config: TextEncoderConfig, tokenizer: WordTokenizer) -> None:
        super().__init__()
        if len(tokenizer) != config.vocab_size:
            raise ValueError(
                f"TinyTextEncoder: tokenizer has {len(tokenizer)} words, config.vocab_size is {config.vocab_size}."
            )
        self.config = config
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_positions, config.hidden_size)
        self.blocks = nn.ModuleList(
            [_Block(config.hidden_size, config.num_heads) for _ in range(config.num_layers)]
        )
        self.norm = nn.LayerNorm(config.hidden_size)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def tokenize(self, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (B, L) long, mask (B, L) long) with L = longest tokenized prompt, padded on the right."""
        max_length = min(max_length, self.config.max_positions)
        if max_length < 1:
            raise ValueError(f"TinyTextEncoder.encode: max_length must be >= 1, got {max_length}.")
        seqs = [self.tokenizer.tokenize(p, max_length) for p in prompts]
        length = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long)
        mask = torch.zeros(len(seqs), length, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask

    def count_tokens(self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH) -> list[int]:
        """Each prompt's embedding length as `encode` makes it (tokenizer only, no model)."""
        max_length = min(max_length, self.config.max_positions)
        return [len(self.tokenizer.tokenize(p, max_length)) for p in prompts]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask: (B, L) -> embeddings (B, L, D); padded positions are zeroed."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(positions)[None]  # (B, L, D)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x) * mask[..., None].to(x.dtype)

    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts -> (embeds (B, L, D) in the module's dtype and device, mask (B, L) long)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise ValueError("TinyTextEncoder.encode: got no prompts.")
        ids, mask = self.tokenize(list(prompts), max_length)
        device = self.embed.weight.device
        ids, mask = ids.to(device), mask.to(device)
        return self.forward(ids, mask), mask

    def save(self, root: Path) -> None:
        """Write `root/text_encoder/{config.json, model.safetensors}` and `root/tokenizer/vocab.json`."""
        out = Path(root) / "text_encoder"
        out.mkdir(parents=True, exist_ok=True)
        config = {"_class_name": "TinyTextEncoder", **asdict(self.config)}
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        self.tokenizer.save(Path(root) / "tokenizer")

    @classmethod
    def load(
        cls, root: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> TinyTextEncoder:
        """Inverse of `save`: strict (every key must match), built on meta then assigned."""
        root = Path(root)
        raw = read_config(root / "text_encoder")
        raw.pop("_class_name", None)
        try:
            config = TextEncoderConfig(**raw)
        except TypeError as e:
            raise WeightsError(
                f"{root / 'text_encoder' / 'config.json'}: {e}. Expected keys {list(TextEncoderConfig.__dataclass_fields__)}."
            ) from e
        tokenizer = WordTokenizer.load(root / "tokenizer")
        with on_meta():
            module = cls(config, tokenizer)
        state = read_state_dict(root / "text_encoder")
        assign_state_dict(module, state, where=str(root / "text_encoder"), dtype=dtype, device=device)
        return module.eval()
