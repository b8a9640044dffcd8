"""The baseline: what users write instead of ditfleet, the way Ray's docs teach it.

A Ray Data pipeline over a diffusers `QwenImagePipeline` (the "Stable Diffusion batch prediction"
and "Working with images" guides): `read_parquet` the prompts, repartitioned so that every actor
gets work -> `map_batches` with a callable class that holds the pipeline, on an actor pool
(`compute=ActorPoolStrategy(size=N)`) -> `write_parquet` of the PNG-encoded images with their
metadata, to S3. Each batch is split by image size, since one diffusers call takes one size.

    python bench/ray_data_baseline.py --address 127.0.0.1:6379 --prompts prompts.parquet \\
        --model /path/to/qwen-image --output s3://bucket/prefix --endpoint-url http://127.0.0.1:9000

With real Qwen-Image weights the class is exactly the docs' (`QwenImagePipeline.from_pretrained`).
With the tiny models there is one deviation, forced by the weights: diffusers' QwenImagePipeline
needs a Qwen2.5-VL text encoder, and the tiny models have their own small one
(`model.tiny.text_encoder`). The class encodes prompts with it and hands diffusers
`prompt_embeds=` / `negative_prompt_embeds=` (which the pipeline accepts); everything after the
text encoder is diffusers' own code.

bench/vs_ray_data.py runs this next to ditfleet. For its measurements each actor appends one JSON
line per batch to `--log-dir` (pid, ids, seconds, peak RSS): instrumentation, not part of what a
user would write.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np


class QwenImageGenerator:
    """Callable class for `map_batches`: loads the pipeline once per actor, then turns a batch
    of prompt rows into PNG bytes plus metadata (input order kept)."""

    def __init__(
        self,
        model_dir: str,
        steps: int,
        true_cfg_scale: float,
        negative_prompt: str,
        max_sequence_length: int = 512,
        log_dir: str | None = None,
    ) -> None:
        import torch
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImagePipeline,
            QwenImageTransformer2DModel,
        )

        root = Path(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        te_config = json.loads((root / "text_encoder" / "config.json").read_text())
        self.text_encoder = None
        if te_config.get("_class_name") == "TinyTextEncoder":
            from ditfleet.model.tiny.text_encoder import TinyTextEncoder

            # The one deviation: diffusers' pipeline takes the tiny model's own text encoder
            # through prompt_embeds; everything from the DiT on is diffusers' code.
            kw: dict[str, Any] = dict(torch_dtype=self.dtype, low_cpu_mem_usage=False)
            self.pipe = QwenImagePipeline(
                scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
                vae=AutoencoderKLQwenImage.from_pretrained(root / "vae", **kw),
                text_encoder=None,
                tokenizer=None,
                transformer=QwenImageTransformer2DModel.from_pretrained(root / "transformer", **kw),
            )
            self.text_encoder = TinyTextEncoder.load(root, device=self.device, dtype=self.dtype)
        else:  # real Qwen-Image weights: exactly the docs' from_pretrained
            self.pipe = QwenImagePipeline.from_pretrained(root, torch_dtype=self.dtype)
        self.pipe = self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self.steps, self.true_cfg_scale = steps, true_cfg_scale
        self.negative_prompt, self.max_sequence_length = negative_prompt, max_sequence_length
        self.log_path = Path(log_dir) / f"{os.getpid()}.jsonl" if log_dir else None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import io

        import torch

        t0 = time.perf_counter()
        self._log({"event": "start", "ids": [str(i) for i in batch["id"]]})
        n = len(batch["id"])
        images: list[bytes] = [b""] * n
        generate_s = encode_s = 0.0
        # A diffusers call takes one size: group the batch by (height, width).
        groups: dict[tuple[int, int], list[int]] = {}
        for i in range(n):
            groups.setdefault((int(batch["height"][i]), int(batch["width"][i])), []).append(i)
        for (height, width), rows in groups.items():
            t = time.perf_counter()
            prompts = [str(batch["prompt"][i]) for i in rows]
            out = self.pipe(
                **self._text_inputs(prompts),
                true_cfg_scale=self.true_cfg_scale,
                height=height,
                width=width,
                num_inference_steps=self.steps,
                generator=[torch.Generator(self.device).manual_seed(int(batch["seed"][i])) for i in rows],
                output_type="pil",
            ).images
            generate_s += time.perf_counter() - t
            t = time.perf_counter()
            for i, image in zip(rows, out):
                buf = io.BytesIO()
                image.save(buf, format="PNG")
                images[i] = buf.getvalue()
            encode_s += time.perf_counter() - t
        self._log(
            {
                "event": "end",
                "generate_s": generate_s,
                "encode_s": encode_s,
                "wall_s": time.perf_counter() - t0,
            }
        )
        return {
            "id": batch["id"],
            "prompt": batch["prompt"],
            "seed": batch["seed"],
            "width": batch["width"],
            "height": batch["height"],
            "steps": np.full(n, self.steps),
            "true_cfg_scale": np.full(n, self.true_cfg_scale),
            "image": np.array(images, dtype=object),
            "format": np.array(["png"] * n, dtype=object),
        }

    def _text_inputs(self, prompts: list[str]) -> dict[str, Any]:
        negatives = [self.negative_prompt] * len(prompts)
        if self.text_encoder is None:
            return {
                "prompt": prompts,
                "negative_prompt": negatives,
                "max_sequence_length": self.max_sequence_length,
            }
        import torch

        with torch.no_grad():
            embeds, mask = self.text_encoder.encode(prompts, self.max_sequence_length)
            neg, neg_mask = self.text_encoder.encode(negatives, self.max_sequence_length)
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "negative_prompt_embeds": neg,
            "negative_prompt_embeds_mask": neg_mask,
        }

    def _log(self, event: dict[str, Any]) -> None:
        """One JSON line per batch start and end (bench instrumentation: pid, time, peak RSS)."""
        if self.log_path is None:
            return
        import resource

        line = {
            "pid": os.getpid(),
            "time": time.time(),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            **event,
        }
        with self.log_path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def s3_filesystem(endpoint_url: str | None, region: str):
    """pyarrow's S3 filesystem (what Ray Data writes through) for an S3-compatible endpoint."""
    from pyarrow import fs

    if not endpoint_url:
        return fs.S3FileSystem(region=region)
    scheme, _, host = endpoint_url.partition("://")
    return fs.S3FileSystem(endpoint_override=host, scheme=scheme, region=region)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="the Ray cluster (GCS address)")
    ap.add_argument("--prompts", required=True, help="prompt Parquet: id, prompt, seed, width, height")
    ap.add_argument("--model", required=True, help="diffusers-layout model folder (transformer/, vae/, ...)")
    ap.add_argument("--output", required=True, help="s3://bucket/prefix for the image Parquet files")
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--true-cfg-scale", type=float, default=4.0)
    ap.add_argument("--negative-prompt", default=" ")  # what a diffusers user passes for true CFG
    ap.add_argument("--concurrency", type=int, default=2, help="actors in the pool")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rows-per-block", type=int, default=16, help="input rows per block (task)")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import ray

    t0 = time.time()
    ray.init(address=args.address, logging_level="WARNING")
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    if hasattr(context, "use_datasource_v2"):
        # Ray 2.60's new Parquet reader starts 32 footer-reader actors to list one small file
        # (about 30 s on a 2-core machine) and yields a single block whatever
        # override_num_blocks says; the classic reader does neither. This favours the baseline.
        context.use_datasource_v2 = False
    rows = pq.read_metadata(args.prompts).num_rows
    # Many blocks, not one, so that every actor gets work (Ray's docs repartition for this).
    ds = ray.data.read_parquet(args.prompts).repartition(max(1, -(-rows // args.rows_per_block)))
    ds = ds.map_batches(
        QwenImageGenerator,
        fn_constructor_kwargs=dict(
            model_dir=args.model,
            steps=args.steps,
            true_cfg_scale=args.true_cfg_scale,
            negative_prompt=args.negative_prompt,
            log_dir=args.log_dir,
        ),
        batch_size=args.batch_size,
        compute=ray.data.ActorPoolStrategy(size=args.concurrency),
        num_cpus=1,
        num_gpus=args.num_gpus,
    )
    ds.write_parquet(args.output, filesystem=s3_filesystem(args.endpoint_url, args.region))
    print(json.dumps({"path": "ray_data", "start": t0, "end": time.time(), "rows": rows}))
    ray.shutdown()


if __name__ == "__main__":
    main()
