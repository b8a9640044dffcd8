"""True classifier-free guidance: when it runs, and what the unconditional branch encodes.

The one home of the rule and of the default negative prompt. Standard library only: the job spec
and the row reader (`ditfleet validate`, `ditfleet plan`) take the default from here without
loading torch; the pipeline, warm-up and the worker's batching take the rule from here.
"""

from __future__ import annotations

from collections.abc import Sequence

# Qwen-Image's default: true CFG needs a negative prompt, and " " is the neutral one.
DEFAULT_NEGATIVE_PROMPT = " "


def cfg_on(true_cfg_scale: float | Sequence[float], has_negative: bool = True) -> bool:
    """Whether true CFG runs: every scale is > 1 and there is a negative prompt to guide against.

    has_negative: False where the negative was set to none (a row's or the job's null
    `negative_prompt`, or embeddings given without negative embeddings).
    """
    scales = true_cfg_scale if isinstance(true_cfg_scale, Sequence) else [true_cfg_scale]
    return has_negative and all(float(s) > 1 for s in scales)


def planned_cfg(true_cfg_scale: float) -> str:
    """The CFG a job's memory plan sizes its batch for (model.memory.Runtime.cfg), from the job's
    default scale: 'off' when it runs no CFG (a few-step checkpoint's, one DiT branch: the larger
    batch issue 50 asks of such jobs where memory allows), else 'serial', the larger of the two
    ways (it holds one output more). A row that turns CFG on in a job planned 'off' needs more
    than its batch was sized for: the worker halves a batch on out-of-memory (workers.generate)."""
    return "serial" if cfg_on(true_cfg_scale) else "off"


def negative_text(negative_prompt: str | None) -> str:
    """The text the unconditional branch encodes: the negative prompt, or the default for None or
    "" (an empty text has no tokens to encode)."""
    return negative_prompt or DEFAULT_NEGATIVE_PROMPT


def negative_texts(count: int, negative_prompts: Sequence[str | None] | str | None) -> list[str]:
    """One negative text per prompt: one string (or None: the default) for all, or one each."""
    if negative_prompts is None or isinstance(negative_prompts, str):
        return [negative_text(negative_prompts)] * count
    texts = [negative_text(n) for n in negative_prompts]
    if len(texts) != count:
        raise ValueError(f"need one negative prompt per prompt: {count} prompts, {len(texts)} negatives")
    return texts
