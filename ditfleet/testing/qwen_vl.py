"""A toy Qwen2.5-VL that sees images, built here (no files fetched): random weights at the family's
toy widths (`toy_config("text_encoder/config.json")`: the published patching), a byte-level BPE
tokenizer trained on the edit template with Qwen's chat and vision tokens, and Qwen2-VL's image
processor; saved as an edit checkpoint lays them out (text_encoder/, tokenizer/, processor/).
Needs transformers and tokenizers (the `test` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ditfleet.model.qwen_image.edit import EDIT_TEMPLATE
from ditfleet.model.qwen_image.family import QWEN_IMAGE

# Qwen's chat and vision tokens, given the first ids; the model config takes the vision ids from
# the tokenizer.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# What the tokenizer is trained on: the edit template around a few instructions.
TRAINING_TEXT = (
    "Picture 1: Picture 2: make the shape blue",
    "turn the red circle into a green square, keep the background",
    "add a small yellow triangle at the top left",
)


def make_vl_tokenizer(out: Path) -> Any:
    """A PreTrainedTokenizerFast (vocabulary 400, right padding) saved to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([EDIT_TEMPLATE.format(t) for t in TRAINING_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        padding_side="right",
        model_max_length=131072,
    )
    fast.save_pretrained(out)
    return fast


def make_vl_model(out: Path, tokenizer: Any, seed: int = 0) -> Any:
    """Qwen2.5-VL at the family's toy widths (hidden 32), random weights, its vision token ids the
    tokenizer's; saved to `out` in safetensors."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    raw = QWEN_IMAGE.toy_config("text_encoder/config.json")
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    raw.update(
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**raw)).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def make_image_processor(out: Path) -> Any:
    """Qwen2-VL's image processor at its published defaults (patch 14, merge 2), saved to `out`:
    the PIL backend, which needs no torchvision."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers 4: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    processor = ImageProcessor()
    processor.save_pretrained(out)
    return processor


def write_toy_qwen_vl(root: Path, seed: int = 0) -> Path:
    """text_encoder/, tokenizer/ and processor/ (the tokenizer and the image processor) under `root`."""
    tokenizer = make_vl_tokenizer(root / "tokenizer")
    make_vl_model(root / "text_encoder", tokenizer, seed)
    make_image_processor(root / "processor")
    tokenizer.save_pretrained(root / "processor")
    return root


def reference_processor(root: Path) -> Any:
    """transformers' Qwen2VLProcessor over `root`'s processor/ without a video processor (which
    wants torchvision): what diffusers' edit pipelines take as `processor`."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    class ImageOnlyProcessor(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    return ImageOnlyProcessor(
        image_processor=AutoImageProcessor.from_pretrained(str(root / "processor")),
        tokenizer=AutoTokenizer.from_pretrained(str(root / "processor")),
    )
