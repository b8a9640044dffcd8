"""One image as Qwen2.5-VL's vision tower takes it: the published preprocessing, in torch.

transformers' `Qwen2VLImageProcessor` does the same on the CPU (PIL or torchvision, depending on
the version and on what is installed); written here so that it runs on the device the image and
the encoder are on, gives the same numbers across transformers versions, and needs no
preprocessor_config.json (Qwen-Image's text_encoder/ folder ships none). The test compares it with
transformers' processor.

The steps (Qwen2-VL's `smart_resize` and `_preprocess`):
1. Resize to (H', W'), multiples of patch * merge (28 at the published sizes), aspect kept, area
   clamped to [MIN_PIXELS, MAX_PIXELS]; bicubic with antialiasing, rounded back to uint8 levels
   as PIL's resize of a uint8 image is.
2. Scale to [0, 1], normalise with CLIP's mean and std.
3. Repeat the frame `temporal_patch_size` times (a still image is a two-frame clip) and cut it
   into patches ordered as the tower expects: merge windows of merge x merge patches, each patch
   flattened as (channel, time, py, px).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditfleet.model.qwen_image.qwen_vision_size import MAX_PIXELS, smart_resize

# Qwen2.5-VL's published preprocessor_config.json (Qwen/Qwen2.5-VL-7B-Instruct): OpenAI CLIP's
# mean and std (the area bounds: model.qwen_image.qwen_vision_size).
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionLayout:
    """The vision tower's patching, from the model config's `vision_config`."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def from_config(cls, vision_config) -> VisionLayout:
        return cls(
            int(vision_config.patch_size),
            int(vision_config.temporal_patch_size),
            int(vision_config.spatial_merge_size),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def vision_input(
    image: torch.Tensor, layout: VisionLayout, max_pixels: int = MAX_PIXELS
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (3, H, W) uint8 image -> (pixel_values (P, 3 * t * p * p) float32, grid_thw (3,) long),
    on the image's device. P = grid_t * grid_h * grid_w patches; the language model sees
    P / merge_size**2 image tokens."""
    _, height, width = image.shape
    h, w = smart_resize(height, width, layout.factor, max_pixels=max_pixels)
    x = image.to(torch.float32)[None]  # (1, 3, H, W) in uint8 levels
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
        x = x.round().clamp(0, 255)  # PIL resizes a uint8 image to uint8
    mean = torch.tensor(IMAGE_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD, device=x.device).view(1, 3, 1, 1)
    x = (x / 255.0 - mean) / std  # (1, 3, h, w)
    t, p, m = layout.temporal_patch_size, layout.patch_size, layout.merge_size
    x = x.expand(t, 3, h, w)  # the still image as a clip of t identical frames
    gh, gw = h // p, w // p
    x = x.reshape(1, t, 3, gh // m, m, p, gw // m, m, p)  # (T, t, C, bh, m, p, bw, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (T, bh, bw, m, m, C, t, p, p)
    patches = x.reshape(gh * gw, 3 * t * p * p)  # (P, C * t * p * p)
    grid = torch.tensor([1, gh, gw], dtype=torch.long, device=x.device)
    return patches, grid
