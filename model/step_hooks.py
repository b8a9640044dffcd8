"""The sampler's per-step hook point: where a step cache (or any per-step policy) plugs in.

`model.sampling.denoise` calls a `StepHook` around every step of the loop:

    hook.start(steps, batch)                       once, before the first step
    forward = hook.forward(step, transformer)      each step: the callable both CFG passes use

`forward` is handed the transformer itself and returns what the sampler calls in its place for
this step, with the transformer's own arguments `(latents, embeds, mask, timestep, img_shapes)`.
A hook that reuses work returns a callable that answers from what it kept (per image, since an
image must depend only on its own prompt, seed and settings); the default returns the transformer
unchanged, so with no hook every step computes exactly what it did before (bit-identical).

Standard library only (torch only for type checking).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

# What the sampler calls for one transformer pass: (latents, embeds, mask, timestep, img_shapes)
# -> velocity. The transformer module itself is one.
Forward = Callable[..., "torch.Tensor"]


@dataclass(frozen=True)
class Step:
    """Where the sampler is: step `index` of `steps` (from 0), going from sigma to sigma_next."""

    index: int
    steps: int
    sigma: Any  # 0-d tensor, the scheduler's sigma at this step
    sigma_next: Any  # 0-d tensor, the sigma this step moves to
    timestep: Any  # the tensor the transformer gets (the same object for both CFG passes)


@runtime_checkable
class StepHook(Protocol):
    """Called by the sampler around every denoising step; see the module docstring."""

    def start(self, steps: int, batch: int) -> None: ...

    def forward(self, step: Step, transformer: Forward) -> Forward: ...


class NoStepHook:
    """The default: every step runs the transformer as it is, and nothing is kept."""

    def start(self, steps: int, batch: int) -> None:
        return None

    def forward(self, step: Step, transformer: Forward) -> Forward:
        return transformer


NO_STEP_HOOK: StepHook = NoStepHook()
