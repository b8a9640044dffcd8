"""Where one batch's time goes, in-process: diffusers' QwenImagePipeline vs ditfleet's pipeline
on the same weights, split into text encoding, denoising (DiT steps with CFG) and VAE decode.

ditfleet is measured as its worker runs it (prompts padded to their prompt-length bucket, 64
tokens at least, see ditfleet/testing/prompt_padding.py), with the prompts unpadded, and with buckets that
start at 16 tokens: that isolates what the padding costs when the image has few tokens. Milliseconds per image: CPU time of this process on a CPU (robust
to other tenants), wall time with the device synchronised on CUDA.

    python bench/pipeline_profile.py MODEL_DIR [--bucket 128x128 --steps 8 --batch 8 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.vs_ray_data_io import prompt_text  # noqa: E402
from ditfleet.compile import PROMPT_LENGTH_BUCKETS  # noqa: E402
from ditfleet.model import load_pipeline  # noqa: E402
from ditfleet.testing.prompt_padding import encode_padded  # noqa: E402

SMALL_FIRST_BUCKETS = (16, 32, *PROMPT_LENGTH_BUCKETS)


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], tuple[float, Any]]:
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time

    def run(fn: Callable[[], Any]) -> tuple[float, Any]:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = clock()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        return clock() - t0, out

    return run


def _diffusers(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    kw = dict(torch_dtype=dtype, low_cpu_mem_usage=False)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(model_dir / "vae", **kw),
        text_encoder=None,
        tokenizer=None,
        transformer=QwenImageTransformer2DModel.from_pretrained(model_dir / "transformer", **kw),
    ).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def profile_pipelines(
    model_dir: Path,
    bucket: str,
    steps: int,
    true_cfg_scale: float,
    batch: int,
    device: str = "cpu",
    rounds: int = 3,
) -> dict[str, Any]:
    """ms per image of each stage, the median over `rounds` after one warm-up round."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    width, height = (int(v) for v in bucket.split("x"))
    ours = load_pipeline(model_dir, dev, dtype)
    ref = _diffusers(Path(model_dir), dev, dtype)
    timed = _timer(dev)
    prompts, seeds = [prompt_text(i) for i in range(batch)], list(range(batch))
    h, w = height // 8, width // 8
    z = torch.randn(batch, 16, h, w, device=dev, dtype=dtype)  # de-normalised latents
    packed = torch.randn(batch, (h // 2) * (w // 2), 64, device=dev, dtype=dtype)
    kw = dict(height=height, width=width, steps=steps, true_cfg_scale=true_cfg_scale, seeds=seeds)

    def text_unpadded() -> dict[str, Any]:
        e, m = ours.encode_prompt(prompts)
        ne, nm = ours.encode_prompt([" "] * batch)
        return dict(
            prompt_embeds=e, prompt_embeds_mask=m, negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm
        )

    def ditfleet(buckets: tuple[int, ...] | None) -> dict[str, float]:
        if buckets is None:
            t_text, inputs = timed(text_unpadded)
        else:
            t_text, inputs = timed(lambda: encode_padded(ours, prompts, " ", true_cfg_scale, buckets))
        t_all, _ = timed(lambda: ours.generate(**inputs, **kw))
        t_dec, _ = timed(lambda: ours.decode(packed, height, width))
        return {"text": t_text, "denoise": t_all - t_dec, "decode": t_dec}

    def diffusers() -> dict[str, float]:
        t_text, inputs = timed(text_unpadded)
        generators = [torch.Generator(dev).manual_seed(s) for s in seeds]
        t_denoise, _ = timed(
            lambda: ref(
                **inputs,
                height=height,
                width=width,
                num_inference_steps=steps,
                true_cfg_scale=true_cfg_scale,
                generator=generators,
                output_type="latent",
            )
        )
        with torch.no_grad():
            t_dec, _ = timed(lambda: ref.vae.decode(z[:, :, None], return_dict=False))
        return {"text": t_text, "denoise": t_denoise, "decode": t_dec}

    variants = {
        "diffusers QwenImagePipeline": diffusers,
        "ditfleet (prompts padded to 64+, as run)": lambda: ditfleet(PROMPT_LENGTH_BUCKETS),
        "ditfleet (prompt buckets from 16)": lambda: ditfleet(SMALL_FIRST_BUCKETS),
        "ditfleet (prompts unpadded)": lambda: ditfleet(None),
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, fn in variants.items():  # interleaved, so machine noise hits all alike
            stages = fn()
            if r:
                samples[name].append(stages)
    pipelines = {}
    for name, runs in samples.items():
        stages = {k: 1000 * statistics.median(s[k] for s in runs) / batch for k in runs[0]}
        stages["total"] = sum(stages.values())
        pipelines[name] = {k: round(v, 1) for k, v in stages.items()}
    return {
        "bucket": bucket,
        "batch": batch,
        "steps": steps,
        "clock": "CPU ms" if dev.type == "cpu" else "GPU wall ms",
        "pipelines": pipelines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--bucket", default="128x128")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--true-cfg-scale", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    result = profile_pipelines(
        args.model_dir, args.bucket, args.steps, args.true_cfg_scale, args.batch, args.device
    )
    from bench.vs_ray_data_report import format_profile

    print(format_profile(result))
    print(json.dumps({"bench": "pipeline_profile", **result}))


if __name__ == "__main__":
    main()
