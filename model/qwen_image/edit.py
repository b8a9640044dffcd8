"""Qwen-Image-Edit as the family runs it: which checkpoints edit, and the sizes their sources take.

Torch-free: the face (model/family.py) reads a checkpoint's task from here, and planning groups
rows by their sources' sizes, without loading torch.

Three published pipeline classes run on the Qwen-Image DiT (diffusers 0.42's
`pipelines/qwenimage/`):
- `QwenImageEditPipeline` (Qwen-Image-Edit): one source; Qwen2.5-VL sees it at the VAE size.
  diffusers' pipeline takes a list as a batch of one source per prompt, and its prompt holds one
  image placeholder: a row with two sources is not an edit of both, so it is refused.
- `QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509, and 2511: the same class, whose transformer
  config sets `zero_cond_t`): one or more sources, each labelled "Picture i:" in the prompt;
  Qwen2.5-VL sees each at a 384 x 384 area, the VAE encodes each at a 1024 x 1024 area. diffusers
  sets no limit (the model card shows 1 to 3; each more source costs its tokens in the prompt and
  the DiT, which the memory plan counts).
The source latents go to the DiT as extra image tokens after the target's (each at the next RoPE
frame index), and the DiT returns the target's only (model.qwen_image.transformer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from ditfleet.model.family_types import EDIT, TEXT_TO_IMAGE, Size, SourceSizes
from ditfleet.model.qwen_image.memory_activations import image_tokens
from ditfleet.model.qwen_image.qwen_vision_size import smart_resize

# The instruction template of both edit pipelines' Qwen2.5-VL prompt encoding; the first
# EDIT_DROP_TOKENS tokens (the system prompt and the user turn's start) are dropped, as for text.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
    "objects, background), then explain how the user's text instruction should alter or modify the "
    "image. Generate a new image that meets the user's requirements while maintaining consistency "
    "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_DROP_TOKENS = 64
# Where an image's vision tokens go in the prompt (the processor expands the pad to the image's
# merged patches).
IMAGE_PAD = "<|image_pad|>"
VISION_PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"
# The area the source is resized to, in pixels, before the VAE encodes it (both classes) and
# before Qwen2.5-VL's processor sees it (Edit Plus; the first edit model shows it the VAE's size).
VAE_SOURCE_AREA = 1024 * 1024
PLUS_VISION_AREA = 384 * 384
# Source sizes are multiples of this (diffusers' calculate_dimensions).
SOURCE_SIZE_MULTIPLE = 32
# Qwen2.5-VL's published patching (14-pixel patches merged 2 x 2): one vision token in the prompt
# per 28 x 28 pixels of the size its processor resizes a source to (smart_resize).
VISION_TOKEN_PIXELS = 28
# Prompt tokens around each source's vision tokens: <|vision_start|> and <|vision_end|>, and for a
# labelled style "Picture i: " ("Picture", " ", "i", ":", " " by Qwen2's pre-tokenizer, which
# splits digits; one more from the 10th source on, not counted).
MARKER_TOKENS = 2
LABEL_TOKENS = 5
# A checkpoint trained with its sources at another area than VAE_SOURCE_AREA names it (pixels) in
# its model_index.json under this key: the bundled tiny edit model's is its buckets' 128 x 128, at
# which it was fine-tuned (recipes/tiny/train_edit.py). diffusers' pipelines ignore the key.
SOURCE_AREA_KEY = "vae_source_area"


@dataclass(frozen=True)
class EditStyle:
    """How one edit pipeline class conditions on its sources.

    labelled: each source is "Picture i: <vision placeholder>" before the instruction (Plus);
      else one placeholder before it (the first edit model).
    vision_area: the area Qwen2.5-VL's processor is handed each source at; None: the VAE size.
    max_sources: the most sources a row may carry (None: any).
    vae_area: the area the VAE encodes each source at (diffusers' VAE_IMAGE_SIZE; a test may
      shrink it on both sides to run faster).
    """

    pipeline_class: str
    labelled: bool
    vision_area: int | None
    max_sources: int | None
    vae_area: int = VAE_SOURCE_AREA

    def prompt_text(self, instruction: str, sources: int) -> str:
        """The text Qwen2.5-VL encodes for one instruction over `sources` images."""
        if self.labelled:
            head = "".join(f"Picture {i + 1}: {VISION_PLACEHOLDER}" for i in range(sources))
        else:
            head = VISION_PLACEHOLDER if sources else ""
        return EDIT_TEMPLATE.format(head + instruction)

    def vision_size(self, width: int, height: int) -> Size:
        """(width, height) a source of that size is resized to before the processor sees it."""
        return source_size(width, height, self.vae_area if self.vision_area is None else self.vision_area)

    def vae_size(self, width: int, height: int) -> Size:
        """(width, height) a source of that size is resized to before the VAE encodes it; its
        token grid is this / 16 (what a batch's rows must share)."""
        return source_size(width, height, self.vae_area)

    def prompt_tokens(self, width: int, height: int) -> int:
        """The tokens a width x height source adds to the prompt the DiT sees when Qwen2.5-VL
        encodes it (its vision tokens at `vision_size` and their markers; an encoder that cannot
        see images adds none)."""
        w, h = self.vision_size(width, height)
        rh, rw = smart_resize(h, w, VISION_TOKEN_PIXELS)
        vision = (rh // VISION_TOKEN_PIXELS) * (rw // VISION_TOKEN_PIXELS)
        return vision + MARKER_TOKENS + (LABEL_TOKENS if self.labelled else 0)

    def check_sources(self, count: int, where: str = "") -> None:
        if count < 1 or (self.max_sources is not None and count > self.max_sources):
            most = "any number" if self.max_sources is None else f"at most {self.max_sources}"
            raise ValueError(
                f"{where or self.pipeline_class}: {count} source images; {self.pipeline_class} takes "
                f"{most} (one or more). Give each row that many images in its image column."
            )


EDIT_STYLES = MappingProxyType(
    {
        "QwenImageEditPipeline": EditStyle("QwenImageEditPipeline", False, None, 1),
        "QwenImageEditPlusPipeline": EditStyle("QwenImageEditPlusPipeline", True, PLUS_VISION_AREA, None),
    }
)


def edit_style_of(model_index: Mapping, where: str = "model_index.json") -> EditStyle | None:
    """The edit style of a checkpoint whose model_index.json holds `model_index` (its
    `_class_name`, and its own source area under `SOURCE_AREA_KEY` when it has one); None for a
    text-to-image one."""
    name = model_index.get("_class_name")
    style = EDIT_STYLES.get(name) if isinstance(name, str) else None
    area = model_index.get(SOURCE_AREA_KEY)
    if style is None or area is None:
        return style
    if isinstance(area, bool) or not isinstance(area, int) or area < SOURCE_SIZE_MULTIPLE**2:
        raise ValueError(
            f"{where}: {SOURCE_AREA_KEY} is {area!r}; give the pixel area the VAE encodes each source at "
            f"(an integer of at least {SOURCE_SIZE_MULTIPLE**2}), or drop the key for {VAE_SOURCE_AREA}."
        )
    return replace(style, vae_area=area)


def task_of_class(class_name: object) -> str:
    """ "edit" for an edit pipeline class of the family, "text-to-image" for any other."""
    return EDIT if isinstance(class_name, str) and class_name in EDIT_STYLES else TEXT_TO_IMAGE


def max_sources_of_class(class_name: object) -> int | None:
    """The most sources a row may carry for a checkpoint of pipeline class `class_name`: its
    edit style's (None: any number); 0 for a text-to-image class, which takes none."""
    style = EDIT_STYLES.get(class_name) if isinstance(class_name, str) else None
    return 0 if style is None else style.max_sources


def source_size(width: int, height: int, area: int = VAE_SOURCE_AREA) -> Size:
    """(width, height) of a width x height source at `area` pixels, its aspect ratio kept, each side
    rounded to a multiple of 32: diffusers' `calculate_dimensions` (the VAE encodes the source at
    this size, so its token grid is this / 16)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"a source image must have a positive size, got {width}x{height}")
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    m = SOURCE_SIZE_MULTIPLE
    return round(w / m) * m, round(h / m) * m


def source_tokens(sizes: SourceSizes, area: int = VAE_SOURCE_AREA) -> int:
    """The image tokens an edit's sources add to every DiT forward: each (width, height) source at
    its VAE size (`source_size`, whatever the target's size), one token per 16 x 16 pixels. The
    DiT carries them through every block beside the target's (model.qwen_image.transformer)."""
    return sum(image_tokens(h, w) for w, h in (source_size(width, height, area) for width, height in sizes))
