"""Flow-match Euler sampling schedule with Qwen-Image's dynamic exponential shift.

sigma goes from 1 (pure noise) to 0. The shift grows with the image token count (mu is linear in
the token count between `base_image_seq_len` and `max_image_seq_len`), then the schedule is
stretched so its last sigma is `shift_terminal` (when set). The model sees t = 1000 * sigma.
What diffusers' FlowMatchEulerDiscreteScheduler computes for the same config, value for value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ditfleet.model.loading.weights import drop_ignored_keys

# Scheduler features we do not implement; a config that turns one on is refused, not ignored.
_UNSUPPORTED_FLAGS = (
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "stochastic_sampling",
    "invert_sigmas",
)
# The transformer's timestep embedding takes t / 1000 (diffusers' convention, whatever the
# scheduler's num_train_timesteps), so a schedule over another range would feed it other times.
TRAIN_TIMESTEPS = 1000
DIFFUSERS_CLASS = "FlowMatchEulerDiscreteScheduler"


@dataclass(frozen=True)
class SchedulerConfig:
    """The keys of diffusers' FlowMatchEulerDiscreteScheduler config that shape the schedule.

    Qwen-Image: dynamic exponential shift (mu from 0.5 at 256 image tokens to 0.9 at 8192),
    stretched to end at 0.02. Qwen-Image-Lightning (distilled for 4-8 steps): base_shift =
    max_shift = ln(3), i.e. a constant shift of 3 whatever the size, and no terminal stretch
    (shift_terminal null).
    """

    num_train_timesteps: int = TRAIN_TIMESTEPS
    use_dynamic_shifting: bool = True
    time_shift_type: str = "exponential"
    base_image_seq_len: int = 256
    max_image_seq_len: int = 8192
    base_shift: float = 0.5
    max_shift: float = 0.9
    shift_terminal: float | None = 0.02
    shift: float = 1.0

    @classmethod
    def from_dict(cls, d: dict, where: str = "scheduler/scheduler_config.json") -> SchedulerConfig:
        """Every key is accounted for: a setting we compute, a feature flag that must be off
        (refused when on), or a key diffusers' FlowMatchEulerDiscreteScheduler does not take
        either (ignored, logged once at debug level, as diffusers does)."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a scheduler config must be a JSON object, got {type(d).__name__}")
        cls_name = d.get("_class_name", DIFFUSERS_CLASS)
        if cls_name != DIFFUSERS_CLASS:
            raise ValueError(
                f"{where}: _class_name is {cls_name!r}; only {DIFFUSERS_CLASS!r} (flow-match Euler) is supported"
            )
        on = [k for k in _UNSUPPORTED_FLAGS if d.get(k)]
        if on:
            raise ValueError(
                f"{where}: {on} are not supported by the flow-match Euler sampler; set them false"
            )
        known = {f.name for f in fields(cls)}
        # Every argument of diffusers' FlowMatchEulerDiscreteScheduler is either a field or an
        # unsupported flag (checked above); anything else diffusers ignores too.
        extra = {
            k: "not an argument of the flow-match Euler scheduler"
            for k in d
            if k not in known and k not in _UNSUPPORTED_FLAGS
        }
        d = drop_ignored_keys({k: v for k, v in d.items() if not k.startswith("_")}, extra, "scheduler")
        config = cls(**{k: v for k, v in d.items() if k in known})
        config.check(where)
        return config

    def check(self, where: str = "scheduler config") -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(
                f"{where}: time_shift_type must be 'exponential' or 'linear', got {self.time_shift_type!r}"
            )
        if self.num_train_timesteps != TRAIN_TIMESTEPS:
            raise ValueError(
                f"{where}: num_train_timesteps {self.num_train_timesteps}; Qwen-Image models take "
                f"timesteps over [0, {TRAIN_TIMESTEPS}]"
            )
        if self.use_dynamic_shifting and self.max_image_seq_len == self.base_image_seq_len:
            raise ValueError(f"{where}: base_image_seq_len and max_image_seq_len must differ")
        if self.shift_terminal is not None and not 0 <= self.shift_terminal < 1:
            raise ValueError(f"{where}: shift_terminal must be in [0, 1) or null, got {self.shift_terminal}")
        if not self.use_dynamic_shifting and self.shift <= 0:
            raise ValueError(f"{where}: shift must be > 0, got {self.shift}")

    def to_dict(self) -> dict:
        return {
            "_class_name": DIFFUSERS_CLASS,
            **{f.name: getattr(self, f.name) for f in fields(self)},
        }


def shift_mu(config: SchedulerConfig, image_seq_len: int) -> float:
    """Linear in the image token count: base_shift at base_image_seq_len, max_shift at max_image_seq_len."""
    m = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
    return image_seq_len * m + (config.base_shift - m * config.base_image_seq_len)


def _linspace(start: float, stop: float, n: int) -> torch.Tensor:
    """numpy.linspace's float64 arithmetic (i * step + start, last = stop), which the reference
    pipeline uses; torch.linspace computes from both ends and can differ in the last bit."""
    if n == 1:
        return torch.tensor([start], dtype=torch.float64)
    y = torch.arange(n, dtype=torch.float64) * ((stop - start) / (n - 1)) + start
    y[-1] = stop
    return y


def sigma_schedule(config: SchedulerConfig, steps: int, image_seq_len: int) -> torch.Tensor:
    """(steps + 1,) fp32 sigmas on CPU, from ~1 down to shift_terminal, then a final 0.

    Every operation is done in fp32 in the reference scheduler's order, so the t it yields (and
    so each bf16 timestep) equals the reference's bit for bit.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigmas = _linspace(1.0, 1.0 / steps, steps).to(torch.float32)
    if config.use_dynamic_shifting:
        mu = shift_mu(config, image_seq_len)
        # As a float32 tensor, not a Python scalar: torch computes `scalar / tensor` as
        # `scalar * reciprocal(tensor)`, which rounds twice and can miss the reference's
        # float32 quotient by one ulp.
        a = torch.tensor(math.exp(mu) if config.time_shift_type == "exponential" else mu, dtype=torch.float32)
        sigmas = a / (a + (1 / sigmas - 1))
    else:
        sigmas = config.shift * sigmas / (1 + (config.shift - 1) * sigmas)
    # With one step the only sigma is 1 and there is nothing to stretch (the reference divides
    # by zero there and returns NaN).
    if config.shift_terminal and float(sigmas[-1]) < 1.0:
        one_minus = 1 - sigmas
        scale = one_minus[-1] / torch.tensor(1 - config.shift_terminal, dtype=torch.float32)
        sigmas = 1 - one_minus / scale
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


def euler_step(
    sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """x_{next} = x + (sigma_next - sigma) * v, computed in fp32, returned in the velocity's dtype."""
    return (sample.float() + (sigma_next - sigma) * velocity).to(velocity.dtype)
