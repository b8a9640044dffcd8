"""`ditfleet calibrate job.yaml --n 64`: what each step-cache preset costs on this model and machine.

The same prompts and seeds are generated exact and with each preset (model.generation.step_cache), on the
job's model, device, dtype, steps, CFG scale, batch size and buckets. Per preset it reports: the
DiT work (block evaluations, exact / with the cache), the wall-time speed-up of the same images,
PSNR and SSIM of every image against its exact twin (mean and worst), and on the bundled tiny
model the adherence scores of model.tiny.adherence next to the exact images' own.

Prompts: the job's input rows (the first n), or on the tiny model its held-out captions (which
adherence can judge). Seeds: the job seed plus the prompt's index, the same in every run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ditfleet.model.loading.folder import TINY_MODEL
from ditfleet.model.step_cache_config import PRESETS, StepCacheConfig, parse_step_cache


@dataclass
class PresetResult:
    """One preset over every image of the calibration."""

    name: str
    settings: str
    images: int = 0
    wall_s: float = 0.0
    blocks_computed: int = 0
    blocks_reused: int = 0
    psnr: list[float] = field(default_factory=list)
    ssim: list[float] = field(default_factory=list)
    adherence: dict[str, float] = field(default_factory=dict)
    # Per bucket, the images made, for the tiny model's adherence (a batch shares one size).
    images_by_bucket: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, bucket: str, images: torch.Tensor, seconds: float, computed: int, reused: int = 0) -> None:
        """One batch: its images, its wall time and its DiT block evaluations."""
        self.images_by_bucket.setdefault(bucket, []).append(images)
        self.images += len(images)
        self.wall_s += seconds
        self.blocks_computed += computed
        self.blocks_reused += reused

    def judge(self, captions: list[str]) -> None:
        """The tiny model's adherence of these images: every bucket has the same captions, so the
        mean over buckets is the mean over images."""
        from ditfleet.model.tiny.adherence import score

        scores = [score(torch.cat(images), captions) for images in self.images_by_bucket.values()]
        self.adherence = {k: sum(s[k] for s in scores) / len(scores) for k in scores[0]}

    @property
    def work_speedup(self) -> float:
        total = self.blocks_computed + self.blocks_reused
        return total / self.blocks_computed if self.blocks_computed else 1.0

    def to_dict(self, exact_wall_s: float) -> dict[str, Any]:
        finite = [p for p in self.psnr if math.isfinite(p)]
        return {
            "preset": self.name,
            "settings": self.settings,
            "images": self.images,
            "blocks_computed": self.blocks_computed,
            "blocks_reused": self.blocks_reused,
            "work_speedup": round(self.work_speedup, 3),
            "wall_s": round(self.wall_s, 3),
            "wall_speedup": round(exact_wall_s / self.wall_s, 3) if self.wall_s else None,
            "psnr_mean_db": round(sum(finite) / len(finite), 2) if finite else math.inf,
            "psnr_min_db": round(min(self.psnr), 2) if self.psnr else None,
            "ssim_mean": round(sum(self.ssim) / len(self.ssim), 5) if self.ssim else None,
            "ssim_min": round(min(self.ssim), 5) if self.ssim else None,
            "adherence": {k: round(v, 4) for k, v in self.adherence.items()},
        }


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image PSNR in dB of images (B, 3, H, W) in [0, 1]; inf for identical images."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(dim=1)
    return 10.0 * torch.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Per image SSIM (Wang et al. 2004: Gaussian 11x11 window, sigma 1.5, K1 0.01, K2 0.03,
    valid region), averaged over the RGB channels; images (B, 3, H, W) in [0, 1]."""
    a, b = a.float(), b.float()
    C = a.shape[1]
    coords = torch.arange(window, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(C, 1, window, window).contiguous()

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, kernel, groups=C)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(dim=1)


def _candidate(text: str) -> StepCacheConfig | None:
    """A preset name, or settings written as in the job file ('{method: teacache, threshold: 0.4}',
    over preset safe unless it names one): what `--preset` takes, so a threshold can be tried
    before it goes into a job."""
    if not text.lstrip().startswith("{"):
        return parse_step_cache(text, key="calibrate --preset")
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"calibrate --preset {text!r}: not a mapping in YAML/JSON: {e}") from e
    return parse_step_cache(value, key=f"calibrate --preset {text}")


def calibrate(
    spec: Any,
    n: int = 64,
    presets: Sequence[str] = ("safe", "fast"),
    steps: int | None = None,
    buckets: Sequence[str] | None = None,
    log=print,
) -> dict[str, Any]:
    """Run the calibration for a JobSpec; returns {"exact": {...}, "presets": [...], ...}."""
    is_tiny = spec.model.path == TINY_MODEL
    run = _Run.of(spec, _prompts(spec, n, is_tiny)[:n], int(steps or spec.sampling_defaults.values["steps"]))
    names = list(buckets or spec.bucket_names())
    configs = _configs(presets, spec.sampling.step_cache, run.steps)
    pipe = _load(spec)
    log(
        f"calibrating {spec.model.path}: {len(run.captions)} prompts x {len(names)} buckets, "
        f"{run.steps} steps, CFG {run.cfg}, batch {run.batch}, presets {list(configs)}"
    )
    # One untimed pass first, so the first timed batch pays no one-off start-up cost.
    w0, h0 = (int(v) for v in names[0].split("x"))
    pipe.generate(
        prompt=run.captions[:1], height=h0, width=w0, steps=1, true_cfg_scale=run.cfg, seeds=run.seeds[:1]
    )
    exact = PresetResult("exact", "off")
    results = {name: PresetResult(name, config.describe()) for name, config in configs.items()}
    for bucket in names:
        _measure_bucket(pipe, run, bucket, configs, exact, results)
        log(f"  {bucket}: done")
    if is_tiny:
        for result in (exact, *results.values()):
            result.judge(run.captions)
    layers = pipe.transformer.config.num_layers
    return {
        "model": spec.model.path,
        "steps": run.steps,
        "true_cfg_scale": run.cfg,
        "buckets": names,
        "prompts": len(run.captions),
        "exact": {
            "wall_s": round(exact.wall_s, 3),
            "blocks": exact.blocks_computed,
            "adherence": exact.adherence,
        },
        "batch_size": run.batch,
        "dit_layers": layers,
        "presets": [
            {**r.to_dict(exact.wall_s), "runs_as": configs[name].runs_as(layers)}
            for name, r in results.items()
        ],
    }


@dataclass(frozen=True)
class _Run:
    """What every run of the calibration shares: the prompts, their seeds and the sampling."""

    captions: list[str]
    seeds: list[int]
    steps: int
    cfg: float
    negative: str | None
    batch: int
    max_sequence_length: int

    @classmethod
    def of(cls, spec: Any, captions: list[str], steps: int) -> _Run:
        """The job's sampling for these prompts at `steps` steps."""
        return cls(
            captions=captions,
            seeds=[int(spec.sampling.seed) + i for i in range(len(captions))],
            steps=steps,
            cfg=float(spec.sampling_defaults.values["true_cfg_scale"]),
            negative=spec.sampling_defaults.values["negative_prompt"],
            batch=int(spec.workers.batch_size),
            max_sequence_length=spec.pipeline_settings().max_sequence_length,
        )


def _configs(presets: Sequence[str], own: StepCacheConfig | None, steps: int) -> dict[str, StepCacheConfig]:
    """The step caches to measure by name: the presets asked for, and the job's own ("job") when
    it is none of them; ValueError for a preset that is off or too long for `steps`."""
    configs: dict[str, StepCacheConfig] = {}
    for name in presets:
        config = _candidate(name)
        if config is None:
            raise ValueError(
                f"calibrate: preset {name!r} is off; name presets that cache ({list(PRESETS)[1:]})"
            )
        configs[name] = config
    if own is not None and all(own != c for c in configs.values()):
        configs["job"] = own
    for name, config in configs.items():
        reason = config.inactive_reason(steps)
        if reason is not None:
            raise ValueError(
                f"calibrate: {steps} steps are too short for preset {name!r} ({reason}); pass --steps"
            )
    return configs


def _load(spec: Any) -> Any:
    """The job's pipeline without its step cache (each run sets its own), on the device and in the
    dtype an actor would choose."""
    from ditfleet.model import load_pipeline
    from ditfleet.workers.actor import resolve_device

    device, dtype = resolve_device(spec.model.device, spec.model.dtype)
    return load_pipeline(
        spec.model_path(),
        device=device,
        dtype=dtype,
        settings=dataclasses.replace(spec.pipeline_settings(), step_cache=None),
        loras=spec.model_loras(),
        scheduler_config=_local_scheduler(spec.model_scheduler_config()),
    )


def _local_scheduler(config: str | None) -> str | None:
    """A published scheduler (`published:...`, a recognised LoRA's) as this machine's file."""
    from ditfleet.model.family import PUBLISHED_SCHEME, published_file

    return str(published_file(config)) if config and config.startswith(f"{PUBLISHED_SCHEME}:") else config


def _measure_bucket(
    pipe: Any,
    run: _Run,
    bucket: str,
    configs: dict[str, StepCacheConfig],
    exact: PresetResult,
    results: dict[str, PresetResult],
) -> None:
    """Every prompt at one bucket, a batch at a time: exact, then with each step cache from the
    same embeddings (encoded once, outside the timings), each compared with its exact twin."""
    from ditfleet.model.generation.pipeline import Sampling

    width, height = (int(v) for v in bucket.split("x"))
    layers = pipe.transformer.config.num_layers
    for start in range(0, len(run.captions), run.batch):
        chunk, seeds = run.captions[start : start + run.batch], run.seeds[start : start + run.batch]
        inputs = pipe.encode_guidance(chunk, run.negative, run.cfg, run.max_sequence_length)
        sampling = Sampling(height, width, run.steps, seeds, run.cfg)
        t0 = time.perf_counter()
        ref = pipe.run(inputs, sampling).images
        blocks = len(chunk) * run.steps * layers * (2 if run.cfg > 1 else 1)
        exact.add(bucket, ref, time.perf_counter() - t0, blocks)
        for name, config in configs.items():
            t0 = time.perf_counter()
            generation = pipe.with_step_cache(config).run(inputs, sampling)
            seconds, out, cache = time.perf_counter() - t0, generation.images, generation.step_cache
            assert cache is not None
            counts = cache.per_image()
            r = results[name]
            computed, reused = (sum(c[k] for c in counts) for k in ("blocks_computed", "blocks_reused"))
            r.add(bucket, out, seconds, computed, reused)
            r.psnr += psnr(out, ref).tolist()
            r.ssim += ssim(out, ref).tolist()


# Wall time below this share of the work's speed-up gets a line saying why.
_WALL_LAGS_WORK = 0.8


def wall_lag_reason(preset: dict[str, Any], result: dict[str, Any]) -> str | None:
    """One line when a preset's wall-time speed-up is well below its DiT-work speed-up: the
    work a step cache saves is DiT blocks, and what else a step costs does not shrink."""
    work, wall = preset["work_speedup"], preset["wall_speedup"]
    if not work or wall >= _WALL_LAGS_WORK * work:
        return None
    return (
        f"wall {wall:.2f}x against {work:.2f}x less DiT work: the cache saves DiT blocks only, and "
        f"here a block is cheap ({result.get('dit_layers')} blocks, batch {result.get('batch_size')}, "
        f"{result['steps']} steps) next to what every step still pays (the cache's own signal and "
        "kept residuals, the text encoder, the VAE decode); on a large model at large sizes blocks "
        "dominate and wall time follows the work"
    )


def format_calibration(result: dict[str, Any]) -> str:
    lines = [
        f"step-cache calibration: {result['model']}, {result['prompts']} prompts x {len(result['buckets'])} "
        f"buckets ({', '.join(result['buckets'])}), {result['steps']} steps, CFG {result['true_cfg_scale']}",
        f"  exact: {result['exact']['blocks']} DiT block evaluations, {result['exact']['wall_s']:.1f} s",
    ]
    exact_adh = result["exact"]["adherence"]
    for p in result["presets"]:
        lines.append(
            f"  {p['preset']}: {p['work_speedup']:.2f}x less DiT work ({p['blocks_computed']} of "
            f"{p['blocks_computed'] + p['blocks_reused']} block evaluations computed), wall {p['wall_speedup']:.2f}x; "
            f"PSNR mean {p['psnr_mean_db']:.1f} dB (worst {p['psnr_min_db']:.1f}), "
            f"SSIM mean {p['ssim_mean']:.4f} (worst {p['ssim_min']:.4f})"
        )
        if p["adherence"]:
            diffs = ", ".join(
                f"{k} {100 * v:.1f}% ({100 * (v - exact_adh[k]):+.1f})"
                if k != "iou"
                else f"iou {v:.3f} ({v - exact_adh[k]:+.3f})"
                for k, v in p["adherence"].items()
            )
            lines.append(f"    adherence vs exact: {diffs}")
        lines.append(f"    runs as: {p['runs_as']}")
        lag = wall_lag_reason(p, result)
        if lag is not None:
            lines.append(f"    why: {lag}")
    lines.append(
        "  Quality is measured against the exact images of the same prompts and seeds; choose a preset "
        "whose cost you accept, on your own model, before a large job."
    )
    return "\n".join(lines)


def _prompts(spec: Any, n: int, is_tiny: bool) -> list[str]:
    if is_tiny:
        from ditfleet.model.tiny.scenes import held_out_captions

        return held_out_captions()
    import pyarrow.dataset as ds

    column = spec.input.prompt_column
    table = ds.dataset(spec.input_uri(), format="parquet").head(n, columns=[column])
    return [str(p) for p in table.column(column).to_pylist()]
