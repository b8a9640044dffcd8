"""The self-test's `vqa` line: the VQAScore of one image at the main size (model.quality.vqa) on a
Qwen2.5-VL of the published layout cut to a few layers, against one DiT step at the same size.

The published text encoder config (model/qwen_image/published) with its language model cut to
`LLM_LAYERS` decoder layers and its vision tower to `VISION_DEPTH` blocks (the last a
full-attention one, as every eighth block of the published 32 is); `--tiny`: toy widths with the
published patching (patch 14, merge 2, two frames). Random weights, made on the device. The
tokenizer is a small byte-level BPE built here: the question's token count is what matters for
the time, not which ids it has.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ditfleet.model.quality.vqa import QUESTION, VQAScore
from ditfleet.workers.selftest import speed  # noqa: F401 - registers images_per_hour, which this line follows
from ditfleet.workers.selftest.parts import FAMILY, sizes, sync, timed_ms
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage

LLM_LAYERS = 2
VISION_DEPTH = 4
PROMPT = "a photograph of a small wooden boat drifting on a calm lake at sunrise, mist over the water"


def encoder_config(
    tiny: bool, llm_layers: int = LLM_LAYERS, vision_depth: int = VISION_DEPTH
) -> dict[str, Any]:
    """Qwen2.5-VL's config: the published one cut to `llm_layers` and `vision_depth`, or toy widths."""
    if tiny:
        return FAMILY.toy_config("text_encoder/config.json")
    config = FAMILY.published_config("text_encoder/config.json")
    text = {**config["text_config"], "num_hidden_layers": llm_layers}
    text["layer_types"] = text["layer_types"][:llm_layers]
    vision = {**config["vision_config"], "depth": vision_depth, "fullatt_block_indexes": [vision_depth - 1]}
    top = {k: v for k, v in config.items() if k not in ("architectures", "text_config", "vision_config")}
    return {**top, "num_hidden_layers": llm_layers, "text_config": text, "vision_config": vision}


def byte_level_tokenizer() -> Any:
    """A byte-level BPE with Qwen's chat special tokens, trained here on the question."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([QUESTION.format(PROMPT), "Yes", "system user assistant"] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def make_encoder(config: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random Qwen2.5-VL of `config` on `device` behind the pipeline's encoder wrapper (the
    family's `random_text_encoder`), with the byte-level tokenizer."""
    return FAMILY.random_text_encoder(config, byte_level_tokenizer(), device, dtype, seed)


@stage("vqa", estimate_s=2, limit_s=60, after="images_per_hour")
def vqa(ctx: Context) -> None:
    """ms per vqa score of one image at the main size (Qwen2.5-VL of the published layout, its
    language model and vision tower cut to a few layers), next to one CFG step of the full DiT."""
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise StageSkipped(f"the vqa scorer needs transformers and tokenizers: {e}") from e
    ctx.emit(_measure(ctx, sizes(ctx)[0]))
    if ctx.cuda:  # the encoder is gone with _measure's frame: its memory goes back for later stages
        torch.cuda.empty_cache()


def _measure(ctx: Context, size: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    encoder = make_encoder(encoder_config(ctx.tiny), ctx.device, ctx.dtype)
    sync(ctx.device)
    make_s = round(time.perf_counter() - t0, 1)
    scorer = VQAScore.from_text_encoder(encoder)
    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (1, 3, size, size), generator=g, dtype=torch.uint8)  # (1, 3, H, W)
    ctx.check("vqa made")
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    scores: list[float] = []
    ms = timed_ms(ctx, lambda: scores.extend(scorer.score(image, [PROMPT])), repeat=ctx.args.repeat)
    step_ms = ctx.state.get("cfg_step_ms", {}).get("cfg")
    line: dict[str, Any] = {
        "status": "measured",
        "size": f"{size}x{size}",
        "llm_layers": encoder.model.config.text_config.num_hidden_layers,
        "vision_depth": encoder.model.config.vision_config.depth,
        "ms_per_image": ms,
        "cfg_step_ms": step_ms,
        "vqa_per_cfg_step": round(ms / step_ms, 3) if step_ms else None,
        "score_in_0_1": all(0.0 <= s <= 1.0 for s in scores),
        "same_score_each_call": len(set(scores)) == 1,
        "make_weights_s": make_s,
    }
    if ctx.cuda:
        line["measured_activations_gb"] = round(
            (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**30, 3
        )
    return line
