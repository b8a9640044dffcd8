"""Which words of a prompt the tiny model knows: its word-level vocabulary, without torch.

The tiny model was trained on one caption template ("a small red circle in the centre on a blue
background"); a word outside its vocabulary encodes as <unk> and gives a picture of something else,
so callers warn, in one line naming the words, instead of making a silently wrong image.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

# The tokenizer's word rule: lower-cased alphanumeric runs (model/tiny/text_encoder.py uses it).
WORD_RE = re.compile(r"[a-z0-9]+")
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>")  # ids 0, 1, 2
EXAMPLE_CAPTION = "a small red circle in the centre on a blue background"
EXAMPLE_INSTRUCTION = "make the shape blue"  # the edit variant's (model.tiny.edits)


@lru_cache(maxsize=4)
def vocabulary(model_dir: str) -> frozenset[str]:
    """The words of the model at `model_dir` (its tokenizer/vocab.json), specials left out."""
    return known_of(json.loads((Path(model_dir) / "tokenizer" / "vocab.json").read_text()))


def known_of(vocab: Iterable[str]) -> frozenset[str]:
    """A tokenizer vocabulary's words, specials left out."""
    return frozenset(w for w in vocab if w not in SPECIAL_TOKENS)


def unknown_words(prompts: Iterable[str], known: frozenset[str]) -> list[str]:
    """The distinct words of `prompts` outside `known`, in first-seen order."""
    seen: dict[str, None] = {}
    for prompt in prompts:
        for word in WORD_RE.findall(prompt.lower()):
            if word not in known:
                seen.setdefault(word, None)
    return list(seen)


def unknown_words_warning(words: list[str], prompts: int, total: int, example: str = EXAMPLE_CAPTION) -> str:
    """One line: which words, in how many prompts, and what the model does draw (`example`: a
    prompt it follows)."""
    shown = ", ".join(repr(w) for w in words[:8]) + (f" and {len(words) - 8} more" if len(words) > 8 else "")
    return (
        f"{prompts} of {total} prompt{'s' if total != 1 else ''} {'uses' if prompts == 1 else 'use'} words "
        "the tiny model does not know "
        f"({shown}): it follows only prompts like {example!r} (docs/tiny-model.md)"
    )
