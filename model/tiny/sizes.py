"""The resolution buckets the bundled tiny model is trained for: its family configuration's
defaults (model.qwen_image.family.TINY), the recipe's and the tests' sizes. Standard library only.
"""

from __future__ import annotations

# Square, landscape 5:3 and portrait 3:5, as (width, height). Latent grids 16x16, 12x20 and 20x12
# are even, as packing needs; small enough for CPU tests.
TINY_BUCKETS: tuple[tuple[int, int], ...] = ((128, 128), (160, 96), (96, 160))
