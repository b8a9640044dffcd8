"""Image scorers: a number per generated image, computed where the image is made (on the actor,
right after decode) or later from the stored file (`ditfleet score`). See base.py for the contract."""
