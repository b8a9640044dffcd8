"""`ditfleet plan job.yaml --selftest selftest.jsonl`: what an image of the job would cost, estimated
from a node self-test's measured lines (workers/selftest/: one JSON object a line).

Per bucket of the job, at its default steps and CFG:

    ms per image = steps x ms per step + ms per decode          (x the worker's overhead)

- ms per step, with CFG: the `cfg_step` line's figure for the job's modulation cache (a serial
  CFG step: the conditional pass, a 4-token negative, the Euler step); without CFG: one forward,
  the `dit_compiled` (or `dit_compiled_other_sizes`) line when the job compiles the DiT, else
  `dit_eager`, else half the CFG step;
- ms per decode: the `vae_decode` line, compiled or eager as the job runs it;
- each measured at a square size and scaled to the bucket by its image tokens (steps) or pixels
  (decode) from the nearest measured size: the DiT's cost grows a little faster than its tokens,
  so a bucket far above the measured size is underestimated;
- the worker's overhead: the `batch_generator` line's `overhead_vs_bare` (the worker's batch
  generator against the bare loop), when there is one.

GPU-seconds per image are that times the job's GPUs per actor; dollars per million at
`cost.gpu_hour_usd` (driver.output.cost). Rows that set their own steps or CFG cost what their
settings do; the estimate is for the job's defaults.

An edit job's rows carry source images, which the self-test's text-to-image lines do not: with
`sources` (each source's (width, height), a row's) and the model's transformer config, each
bucket's step is scaled by the family's FLOPs of a forward with those sources over one without
(`forward_flops(..., sources=)`: their latent tokens at the VAE's source size), at the measured
line's text length. A family that states no FLOPs (0) gets no scaling, and the estimate says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ditfleet.driver.output.cost import image_cost, money_phrase
from ditfleet.jobs.exit_codes import UsageError
from ditfleet.jobs.spec import JobSpec
from ditfleet.model.family import SourceSizes, model_family
from ditfleet.model.generation.guidance import cfg_on
from ditfleet.model.settings import resolve_modulation_cache

PATCH = 16  # pixels per image token side (VAE 8x, patch 2x)
# The self-test's speed lines' prompt length where a line does not say (its --text-len default).
DEFAULT_TEXT_LEN = 128


def read_selftest(path: str) -> list[dict[str, Any]]:
    """The lines of a self-test's selftest.jsonl; UsageError naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(
            f"--selftest {path}: cannot read it ({e}); give the selftest.jsonl a self-test wrote"
        ) from e
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as e:
            raise UsageError(
                f"--selftest {path}: line {n} is not JSON ({e}); give the selftest.jsonl a self-test wrote"
            ) from e
        if isinstance(line, dict):
            lines.append(line)
    return lines


def _measured(lines: Sequence[dict[str, Any]], *stages: str) -> list[dict[str, Any]]:
    return [x for x in lines if x.get("stage") in stages and x.get("status") == "measured" and "size" in x]


def _side(size: str) -> int:
    return int(size.split("x")[0])


def _nearest(lines: Sequence[dict[str, Any]], pixels: int) -> dict[str, Any] | None:
    """The line measured at the square size nearest `pixels` (by area)."""
    return min(lines, key=lambda x: abs(_side(x["size"]) ** 2 - pixels), default=None)


def _scaled(line: dict[str, Any], value: float, width: int, height: int) -> float:
    """`value`, measured at the line's square size, for a width x height image (by area: image
    tokens for the DiT, pixels for the VAE, the same ratio)."""
    return value * (width * height) / _side(line["size"]) ** 2


def _edit_factor(
    spec: JobSpec,
    config: Mapping[str, Any] | None,
    line: Mapping[str, Any],
    width: int,
    height: int,
    sources: SourceSizes,
) -> float | None:
    """An edit step's cost over the text step `line` measured (1.0 for a text job; None when the
    family states no FLOPs or the config is unknown)."""
    if not sources:
        return 1.0
    if config is None:
        return None
    family, text_len = model_family(spec.model.path), int(line.get("text_len") or DEFAULT_TEXT_LEN)
    text = family.forward_flops(dict(config), width, height, text_len)
    return family.forward_flops(dict(config), width, height, text_len, sources) / text if text else None


def estimate_cost(
    spec: JobSpec,
    lines: Sequence[dict[str, Any]],
    source: str,
    *,
    compiled_dit: bool,
    compiled_vae: bool,
    sources: SourceSizes = (),
    transformer_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan's `cost`: per bucket, seconds per image and dollars per million, and what they
    were estimated from; compiled_dit, compiled_vae: the plan's compile decisions; sources,
    transformer_config: an edit job's sources per row and the model's DiT config (the module's
    docstring). Raises UsageError when the lines hold no CFG step or decode figure."""
    cfg_lines = _measured(lines, "cfg_step")
    decode_lines = _measured(lines, "vae_decode")
    if not cfg_lines or not decode_lines:
        raise UsageError(
            f"--selftest {source}: no measured cfg_step and vae_decode lines; run the self-test's speed "
            "stages (python -m ditfleet.workers.selftest --out DIR) on the node kind the job runs on"
        )
    forward_lines = _measured(lines, "dit_compiled", "dit_compiled_other_sizes") if compiled_dit else []
    forward_lines = forward_lines or _measured(lines, "dit_eager")
    worker = _measured(lines, "batch_generator")
    overhead = float(worker[-1].get("overhead_vs_bare") or 1.0) if worker else 1.0
    mode = resolve_modulation_cache(spec.model.modulation_cache, spec.actor_device())
    sampling = spec.sampling
    with_cfg = cfg_on(sampling.true_cfg_scale, has_negative=sampling.negative_prompt is not None)
    gpus = spec.gpus_per_actor()
    price = spec.cost.gpu_hour_usd if gpus else None
    by_bucket: dict[str, Any] = {}
    for bucket in spec.bucket_names():
        width, height = (int(v) for v in bucket.split("x"))
        area = width * height
        step_line = _nearest(cfg_lines, area)
        assert step_line is not None
        steps_ms = step_line["ms_per_cfg_step"]
        cfg_ms = _scaled(step_line, float(steps_ms.get(mode, steps_ms.get("cfg"))), width, height)
        forward = _nearest(forward_lines, area)
        if with_cfg:
            step_ms, step_from = cfg_ms, f"cfg_step {step_line['size']}"
        elif forward is not None:
            step_ms, step_from = (
                _scaled(forward, float(forward["ms_per_forward"]), width, height),
                f"{forward['stage']} {forward['size']}",
            )
        else:
            step_ms, step_from = cfg_ms / 2, f"half a cfg_step {step_line['size']}"
        edit = _edit_factor(spec, transformer_config, step_line, width, height, sources)
        step_ms *= edit or 1.0
        decode = _nearest(decode_lines, area)
        assert decode is not None
        decode_ms = _scaled(
            decode, float(decode["compiled_ms" if compiled_vae else "eager_ms"]), width, height
        )
        ms = (sampling.steps * step_ms + decode_ms) * overhead
        by_bucket[bucket] = image_cost(
            ms / 1000 * (gpus or 1.0),
            price,
            step_from=step_from,
            decode_from=f"vae_decode {decode['size']}",
            **({"edit_step_factor": edit} if sources else {}),
        )
    env = next((x for x in lines if x.get("stage") == "env"), {})
    device = env.get("gpu") or env.get("device")
    return {
        "source": source,
        # A --tiny run measures a model of a few blocks: its figures are no real model's.
        "device": f"{device}, a --tiny self-test" if env.get("tiny") else device,
        "unit": "GPU" if gpus else "actor",
        "gpu_hour_usd": spec.cost.gpu_hour_usd,
        "steps": sampling.steps,
        "cfg": with_cfg,
        "worker_overhead": overhead,
        "sources": [f"{w}x{h}" for w, h in sources],
        "by_bucket": by_bucket,
    }


def cost_plan_line(cost: Mapping[str, Any]) -> str:
    """The plan's cost line: estimated per bucket, from what."""
    unit = f"{cost['unit']}-s/image"
    parts = []
    for bucket, c in cost["by_bucket"].items():
        edit = ""
        if "edit_step_factor" in c:  # an edit job: the step counts the row's sources, or says it cannot
            factor = c["edit_step_factor"]
            edit = (
                f" (step x{factor:.2f} for the sources)"
                if factor
                else " (sources not counted: no FLOPs stated)"
            )
        parts.append(
            f"{bucket} {c['seconds_per_image']:.3g} {unit}{edit}{money_phrase(c['usd_per_million'])}"
        )
    n = len(cost.get("sources") or ())
    sources = f", {n} source{'s' * (n > 1)} a row" if n else ""
    head = f"estimated from {cost['source']} ({cost['device']}; {cost['steps']} steps, CFG {'on' if cost['cfg'] else 'off'}{sources}"
    head += (
        f", worker overhead x{cost['worker_overhead']:.3g}): " if cost["worker_overhead"] != 1.0 else "): "
    )
    tail = (
        f" at ${cost['gpu_hour_usd']:,.2f} per GPU hour"
        if cost["unit"] == "GPU" and cost["gpu_hour_usd"]
        else ""
    )
    return head + ", ".join(parts) + tail
