"""What an image costs: GPU-seconds per image by bucket, and dollars per million images at the
price of a GPU hour the job names (`cost.gpu_hour_usd`).

`ditfleet run`'s summary, `_SUCCESS` and `ditfleet report` give two figures, each named as what it is:
- generation, by bucket: the manifests' `generate_s` (an image's share of its batch's time, every
  quality-gate try included) times the GPUs per actor, over the committed images: what an image
  costs while the fleet generates;
- fleet: this run's GPU hours (start-up, generating and idle: DispatchResult.fleet) over the
  images it made: what the run cost per image, everything included.
`ditfleet plan` estimates the generation figure from a node self-test's measured lines
(jobs/plan_command.py). Actors without GPUs are counted in actor-seconds, and get no dollars.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ditfleet.model.settings import setting

HOUR_S = 3600.0
MILLION = 1_000_000


@dataclass(frozen=True)
class CostConfig:
    gpu_hour_usd: float | None = setting(
        None,
        gt=0,
        description="Price of one GPU hour in US dollars: `ditfleet run`'s summary, `_SUCCESS`, the "
        "report and `ditfleet plan --selftest` give the cost per million images at it. Null: "
        "GPU-seconds per image only.",
    )


def usd_per_million(seconds_per_image: float, gpu_hour_usd: float | None) -> float | None:
    """Dollars per million images at `gpu_hour_usd` (None without a price)."""
    if gpu_hour_usd is None:
        return None
    return round(seconds_per_image * MILLION / HOUR_S * gpu_hour_usd, 2)


def image_cost(seconds_per_image: float, gpu_hour_usd: float | None, **more: Any) -> dict[str, Any]:
    """One figure: seconds per image (GPU-seconds, or actor-seconds without GPUs) and its dollars
    per million images (None without a price or without GPUs)."""
    return {
        **more,
        "seconds_per_image": round(seconds_per_image, 4),
        "usd_per_million": usd_per_million(seconds_per_image, gpu_hour_usd),
    }


def cost_summary(
    images_by_bucket: Mapping[str, int],
    generate_s_by_bucket: Mapping[str, float],
    fleet: Mapping[str, Any],
    fleet_images: int,
    gpus_per_actor: float,
    gpu_hour_usd: float | None,
) -> dict[str, Any]:
    """The summary's `cost`: by bucket (generation) and the fleet's, per image; {} when no image
    was counted. images_by_bucket, generate_s_by_bucket: over the committed manifests; fleet:
    DispatchResult.fleet of this run ({}: nothing dispatched), which made `fleet_images`."""
    if not sum(images_by_bucket.values()):
        return {}
    gpus = gpus_per_actor or 0.0
    price = gpu_hour_usd if gpus else None  # a price per GPU hour says nothing of a CPU actor
    per_actor = gpus or 1.0
    out: dict[str, Any] = {
        "unit": "GPU" if gpus else "actor",
        "gpus_per_actor": gpus,
        "gpu_hour_usd": gpu_hour_usd,
        "by_bucket": {
            bucket: image_cost(generate_s_by_bucket.get(bucket, 0.0) * per_actor / n, price, images=n)
            for bucket, n in sorted(images_by_bucket.items())
            if n
        },
    }
    hours = fleet.get("gpu_hours" if gpus else "actor_hours")
    if hours and fleet_images:
        out["fleet"] = image_cost(hours * HOUR_S / fleet_images, price, images=fleet_images)
    return out


def money_phrase(usd: float | None) -> str:
    """The phrase ' ($X per million)' of a cost line; empty without a price."""
    return "" if usd is None else f" (${usd:,.2f} per million)"


def cost_line(cost: Mapping[str, Any]) -> str:
    """'1024x1024 1.10 GPU-s/image ($763.89 per million), ... at $2.50 per GPU hour; the fleet's ...'."""
    unit = f"{cost['unit']}-s/image"
    parts = [
        f"{bucket} {c['seconds_per_image']:.2f} {unit}{money_phrase(c['usd_per_million'])}"
        for bucket, c in cost["by_bucket"].items()
    ]
    line = ", ".join(parts) + " generating"
    if cost["unit"] == "GPU" and cost.get("gpu_hour_usd") is not None:
        line += f" at ${cost['gpu_hour_usd']:,.2f} per GPU hour"
    fleet = cost.get("fleet")
    if fleet:
        line += f"; this run's fleet {fleet['seconds_per_image']:.2f} {unit}{money_phrase(fleet['usd_per_million'])} with start-up and idle"
    if cost["unit"] == "GPU" and cost.get("gpu_hour_usd") is None:
        line += " (cost.gpu_hour_usd: dollars per million)"
    elif cost["unit"] == "actor":
        line += " (no GPUs: cost.gpu_hour_usd prices GPU hours)"
    return line
