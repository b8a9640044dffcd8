"""Image scorers: a number per generated image, computed where the image is made (on the actor,
right after decode) or later from the stored file (`ditfleet score`). table.py holds one row per
scorer (torch-free: the job spec reads it), base.py the contract, registry.py how each is built.

Names load on first use (PEP 562), so the job spec reads the table without loading torch.
"""

from __future__ import annotations

from ditfleet.model.lazy_exports import lazy_exports

# name -> the submodule that defines it
_WHERE = {
    "ImageScorer": "base",
    "ScorerInputs": "base",
    "scorer": "registry",
}

__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
