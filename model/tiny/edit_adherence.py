"""How well edited scene images follow their instructions, by the tiny model's plain image analysis.

An edited image passes when it shows the instruction (the attribute it named has the new value)
AND keeps what it did not name (every other attribute is the source's): each measured by
`model.tiny.adherence.measure` (background, shape colour, kind, size, position), compared with
the target scene `model.tiny.edits.apply_edit` gives. A copy of the source fails (it shows no
edit), and so does a redraw that gets the edit right but loses, say, the position.

The images an edit model is judged on (recipes/tiny/evaluate.py): the 64 held-out scenes
(`edits.held_out_edits`), each drawn centred at the bucket's size as the source
(`source_pixels`), one fixed seed each, through the model's pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ditfleet.model.tiny.adherence import measure
from ditfleet.model.tiny.edits import ATTRIBUTES, Edit, apply_edit, render_pairs
from ditfleet.model.tiny.scenes import Scene

# Scene's field -> the Measurement's field that reads it back.
_MEASURED = {
    "color": "color",
    "background": "background",
    "shape": "kind",
    "size": "size",
    "position": "position",
}


def edit_score(images: torch.Tensor, pairs: Sequence[tuple[Scene, Edit]]) -> dict[str, float]:
    """images: (B, 3, H, W) in [0, 1], the edits of `pairs` (source scene, edit), in order.

    Returns shares of the images: "edited" (the named attribute reads as the instruction asked),
    "kept" (every other attribute reads as the source's), "adherence" (both), and "adherence
    <attribute>" over the images whose instruction named that attribute."""
    if images.ndim != 4 or images.shape[0] != len(pairs):
        raise ValueError(
            f"edit_score: got {tuple(images.shape)} images for {len(pairs)} edits; expected (B, 3, H, W), B = len(pairs)."
        )
    edited = kept = both = 0
    per = {a: [0, 0] for a in ATTRIBUTES}  # attribute -> [passed, asked]
    for image, (source, edit) in zip(images, pairs):
        want = apply_edit(source, edit)
        got = measure(image)
        right = {a: getattr(got, _MEASURED[a]) == getattr(want, a) for a in ATTRIBUTES}
        shows = right[edit.attribute]
        keeps = all(ok for a, ok in right.items() if a != edit.attribute)
        edited += shows
        kept += keeps
        both += shows and keeps
        per[edit.attribute][0] += shows and keeps
        per[edit.attribute][1] += 1
    n = max(1, len(pairs))
    result = {"edited": edited / n, "kept": kept / n, "adherence": both / n}
    result.update({f"adherence {a}": passed / asked for a, (passed, asked) in per.items() if asked})
    return result


def source_pixels(pairs: Sequence[tuple[Scene, Edit]], width: int, height: int) -> torch.Tensor:
    """Each pair's source scene, centred, as 8-bit RGB pixels (B, height, width, 3) uint8: the
    picture an edit job decodes from the source's PNG."""
    sources, _ = render_pairs(list(pairs), width, height)
    return (sources * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
