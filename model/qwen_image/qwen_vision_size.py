"""The size Qwen2.5-VL's preprocessing takes an image to (Qwen2-VL's `smart_resize`), torch-free:
the vqa scorer resizes by it (model.quality.qwen_vision_input) and the memory plan counts the
vision tower's patches by it (model.qwen_image.memory_activations) without loading torch."""

from __future__ import annotations

import math

# Qwen2.5-VL's published preprocessor_config.json (Qwen/Qwen2.5-VL-7B-Instruct): the image area
# bounds in pixels (4 to 16384 merged tokens of 28 x 28).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 16384
MAX_ASPECT = 200  # smart_resize refuses more elongated images


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """Qwen2-VL's target size: each side a multiple of `factor`, the area within the bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(
            f"a {width}x{height} image is more than {MAX_ASPECT}:1, which Qwen2.5-VL's preprocessing refuses"
        )
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w
