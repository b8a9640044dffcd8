"""What the `tiny` scorer does not see (docs/quality.md, "What `tiny` does not see"): it reads five
attributes from one mask's median colour, centroid and bounding box, so a smudge fainter than its
mask threshold, and a ragged outline with the right bounding box, both score a full 1.0."""

from __future__ import annotations

import torch

from ditfleet.model.quality.tiny_adherence import TinyAdherence
from ditfleet.model.tiny.adherence import MASK_THRESHOLD
from ditfleet.model.tiny.scenes import Scene, render

CAPTION = "a large red square in the centre on a blue background"


def _pixels(image: torch.Tensor) -> torch.Tensor:
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)[None]  # (1, 3, H, W)


def test_a_smudge_and_a_ragged_outline_both_pass_the_tiny_scorer():
    scene = Scene(shape="square", size="large", color="red", position="centre", background="blue")
    clean = render(scene, 128, 128)
    scorer = TinyAdherence()
    assert scorer.score(_pixels(clean), [CAPTION]) == [1.0]

    # A grey smear over the top half, fainter than the mask threshold: invisible to the scorer.
    smudged = clean.clone()
    smudged[:, :64, :] += 0.8 * MASK_THRESHOLD / 3**0.5  # a grey shift 0.8x the threshold's colour distance
    assert (smudged - clean).abs().max() > 0.1  # plainly there to an eye
    assert scorer.score(_pixels(smudged), [CAPTION]) == [1.0]

    # The square's inner edge rows eaten away at random: the box, fill, colour and centre hold.
    ragged = clean.clone()
    inside = (clean - clean[:, :1, :1]).norm(dim=0) > MASK_THRESHOLD  # the drawn square
    ys, xs = torch.nonzero(inside, as_tuple=True)
    edge = (ys == ys.min() + 1) | (ys == ys.max() - 1) | (xs == xs.min() + 1) | (xs == xs.max() - 1)
    bitten = edge & (torch.rand(edge.shape, generator=torch.Generator().manual_seed(0)) < 0.5)
    ragged[:, ys[bitten], xs[bitten]] = clean[:, :1, :1].view(3, 1)
    assert bitten.sum() > 20
    assert scorer.score(_pixels(ragged), [CAPTION]) == [1.0]
