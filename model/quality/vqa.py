"""Prompt faithfulness as VQAScore (Lin et al., "Evaluating Text-to-Visual Generation with
Image-to-Text Generation", 2024), asked of the node's own Qwen2.5-VL: the text encoder Qwen-Image
already loads is a whole vision-language model (vision tower, language model and LM head), so the
score needs no weights of its own.

The score of an image is P("Yes" | image, question): the chat-templated question below, with the
image in the user turn, then the assistant turn's start; the language model's next-token logits
there, softmaxed over the full vocabulary (float32), read at the token of "Yes". Where the
tokenizer spells "Yes" in several tokens (a test's tiny tokenizer; Qwen's own has one), the score
is the product of each token's probability given the ones before it (teacher forcing), which is
the same definition. A probability in [0, 1].

Each image is scored alone (one forward per image, nothing padded), so its score does not depend
on its batch-mates. The forward runs wherever the encoder's weights are at the time: next to the
DiT (`model.text_encoder: gpu`) or on the CPU (`cpu`, and `offload` between its visits to the GPU).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .luma import score_each
from .qwen_vision_input import MAX_PIXELS, VisionLayout, vision_input
from .table import scorer_row

# The paper's question and answer (t2v_metrics' default templates), in Qwen2.5-VL's chat template
# with its default system message.
QUESTION = 'Does this figure show "{}"? Please answer yes or no.'
ANSWER = "Yes"
CHAT_BEFORE_IMAGE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
CHAT_AFTER_IMAGE = "{}<|im_end|>\n<|im_start|>assistant\n"


class VQAScore:
    """P("Yes") from a transformers Qwen2_5_VLForConditionalGeneration, per image, in [0, 1]."""

    name = "vqa"
    higher_is_better = scorer_row(name).higher_is_better

    def __init__(self, model: Any, tokenizer: Any, max_pixels: int = MAX_PIXELS) -> None:
        config = model.config
        self.model, self.tokenizer, self.max_pixels = model, tokenizer, max_pixels
        self.layout = VisionLayout.from_config(config.vision_config)
        self.image_token = int(config.image_token_id)
        self.vision_start = int(config.vision_start_token_id)
        self.vision_end = int(config.vision_end_token_id)
        self.answer = self._ids(ANSWER)
        self.before_image = self._ids(CHAT_BEFORE_IMAGE)
        # Keyword arguments that came and went across transformers versions: 5.x places the image
        # tokens' M-RoPE positions from mm_token_type_ids (without it, silently as text); 4.5x
        # finds them by image_token_id and has no such argument. logits_to_keep spares the
        # vocabulary-wide logits of every position (2,300 x 152,064 floats at 1328x1328).
        params = inspect.signature(model.forward).parameters
        self._pass_token_types = "mm_token_type_ids" in params
        self._pass_logits_to_keep = "logits_to_keep" in params

    @classmethod
    def from_text_encoder(cls, encoder: Any) -> VQAScore:
        """The scorer over a loaded `QwenVLTextEncoder` (model.qwen_image.text_encoder); ValueError for an
        encoder that is not a Qwen2.5-VL with its vision tower."""
        model = getattr(encoder, "model", None)
        if model is None or not hasattr(getattr(model, "config", None), "vision_config"):
            raise ValueError(
                f"quality.scorers: 'vqa' asks the model's own Qwen2.5-VL text encoder, but this model's "
                f"text encoder is {type(encoder).__name__}. Use a Qwen-Image checkpoint as model.path, "
                "or leave 'vqa' out"
            )
        return cls(model, encoder.tokenizer)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, pixels: torch.Tensor, prompts: Sequence[str]) -> list[float]:
        return score_each(self.name, pixels, prompts, self._one)

    def input_ids(self, prompt: str, image_tokens: int) -> list[int]:
        """The question's token ids with `image_tokens` image placeholders, then every answer
        token but the last (the logits at the last positions predict the answer's tokens)."""
        image = [self.vision_start, *[self.image_token] * image_tokens, self.vision_end]
        after = self._ids(CHAT_AFTER_IMAGE.format(QUESTION.format(prompt)))
        return [*self.before_image, *image, *after, *self.answer[:-1]]

    @torch.no_grad()
    def _one(self, image: torch.Tensor, prompt: str) -> float:
        weight = next(self.model.parameters())
        patches, grid = vision_input(image.to(weight.device), self.layout, self.max_pixels)  # (P, D), (3,)
        ids = self.input_ids(prompt, patches.shape[0] // self.layout.merge_size**2)
        input_ids = torch.tensor([ids], device=weight.device)  # (1, T)
        k = len(self.answer)
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=patches.to(weight.dtype),
            image_grid_thw=grid[None],  # (1, 3)
            use_cache=False,
        )
        if self._pass_token_types:
            kwargs["mm_token_type_ids"] = (input_ids == self.image_token).int()  # 1: image, 0: text
        if self._pass_logits_to_keep:
            kwargs["logits_to_keep"] = k
        try:
            logits = self.model(**kwargs).logits[0, -k:]  # (k, V)
        finally:
            # The model keeps this forward's M-RoPE offsets for a generation that would follow; the
            # same model encodes prompts next, so it is left as prompt encoding expects it.
            inner: Any = getattr(self.model, "model", None)
            if hasattr(inner, "rope_deltas"):
                inner.rope_deltas = None
        logp = logits.float().log_softmax(-1)  # (k, V)
        answer = torch.tensor(self.answer, device=logp.device)[:, None]  # (k, 1)
        return float(logp.gather(-1, answer).sum().exp())
