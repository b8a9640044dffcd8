"""Each family: the ditfleet worker vs diffusers' bare pipeline loop on one toy checkpoint, side
by side in one run (CPU time of this process per image), and the actor's start-up with compile
and warm-up per bucket.

The checkpoints are toy-width and random, built here (nothing is downloaded):
- `flux`, `sd3`: the diffusers family (a checkpoint without a native family runs through
  diffusers' own pipeline class): a FluxPipeline and a StableDiffusion3Pipeline made with
  diffusers' classes (ditfleet.testing.diffusers_models). The bare loop is the worker's own
  diffusers pipeline object.
- `qwen-image`: the native Qwen-Image family (ditfleet's DiT, VAE and sampler) on diffusers'
  QwenImageTransformer2DModel / AutoencoderKLQwenImage weights with a toy Qwen2.5-VL text encoder
  (ditfleet.testing.models, ditfleet.testing.qwen_vl), 50-step-style true CFG at `--steps`; the
  bare loop is diffusers' QwenImagePipeline over the same folder.
- `qwen-image-flash`: the same checkpoint at the few-step schedule the distilled checkpoints
  publish (Qwen-Image-Flash, the Lightning LoRAs): 4 steps, CFG off.
- `qwen-image-edit`: the native edit model (write_toy_edit_checkpoint with the toy Qwen2.5-VL)
  against diffusers' QwenImageEditPlusPipeline, one source per row at the published source areas,
  batch 1 on both sides (diffusers' edit pipelines give every prompt of a call the same images).

Both sides get the same prompts, negative prompt, guidance, steps, sizes and one seed per image
(the input's `seed` column). The worker (workers.actor.GenerationWorker, no Ray) also encodes
every PNG, writes it and commits the shard's manifest to a local folder.

    python bench/diffusers_family.py                        # every pipeline, CPU, compile off
    python bench/diffusers_family.py --pipeline qwen-image,sd3   # some of them
    python bench/diffusers_family.py --compile              # + the compiled start-up per bucket
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ditfleet.compile import CompileConfig
from ditfleet.compile.buckets import BucketSet
from ditfleet.model.diffusers_pipeline.published import for_checkpoint
from ditfleet.model.family import model_family
from ditfleet.model.settings import PipelineSettings
from ditfleet.testing.diffusers_models import make_flux_dir, make_sd3_dir
from ditfleet.testing.models import write_toy_edit_checkpoint
from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import ModelPlacement, WorkerConfig
from ditfleet.workers.rows import RowConfig, ShardSpec

NEGATIVE = " "  # the native family's default negative prompt, given to both sides
PROMPTS = [
    f"a small {c} {s} on a white background" for c in ("red", "blue", "green") for s in ("circle", "square")
]
EDITS = ["make the shape blue", "turn the red circle into a green square", "add a small yellow triangle"]


@dataclass(frozen=True)
class Case:
    """One row of the table: how its checkpoint is made, its schedule, and the bare loop's pipeline."""

    build: Callable[[Path], Path]
    steps: int | None  # None: --steps
    true_cfg_scale: float
    reference: Callable[[Path, GenerationWorker], object]  # (checkpoint, worker) -> diffusers pipeline
    kind: str  # which keyword arguments the bare call takes: "diffusers", "qwen", "edit"
    batch_size: int | None = None  # None: --batch-size
    images: int | None = None  # at most this many (of --images)


def _own_pipeline(_root: Path, worker: GenerationWorker) -> object:
    return worker.pipe.pipeline  # the diffusers pipeline the worker runs, for the bare loop


def _qwen_components(root: Path) -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(root / "vae").eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(root / "text_encoder").eval(),
        tokenizer=AutoTokenizer.from_pretrained(root / "tokenizer"),
        transformer=QwenImageTransformer2DModel.from_pretrained(root / "transformer").eval(),
    )


def _qwen_reference(root: Path, _worker: GenerationWorker) -> object:
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_qwen_components(root))


def _edit_reference(root: Path, _worker: GenerationWorker) -> object:
    from diffusers import QwenImageEditPlusPipeline

    from ditfleet.testing.qwen_vl import reference_processor

    return QwenImageEditPlusPipeline(**_qwen_components(root), processor=reference_processor(root))


def _qwen_text_to_image(root: Path) -> Path:
    # The edit checkpoint's builder with the text-to-image class: diffusers' DiT, VAE and scheduler
    # at toy widths and a toy Qwen2.5-VL (the text encoder Qwen-Image publishes), one folder.
    return write_toy_edit_checkpoint(root, text_encoder="qwen-vl", pipeline_class="QwenImagePipeline")


def _qwen_edit(root: Path) -> Path:
    return write_toy_edit_checkpoint(root, text_encoder="qwen-vl")


CASES = {
    "flux": Case(make_flux_dir, None, 1.0, _own_pipeline, "diffusers"),
    "sd3": Case(make_sd3_dir, None, 5.0, _own_pipeline, "diffusers"),
    "qwen-image": Case(_qwen_text_to_image, None, 4.0, _qwen_reference, "qwen"),
    "qwen-image-flash": Case(_qwen_text_to_image, 4, 1.0, _qwen_reference, "qwen"),
    "qwen-image-edit": Case(_qwen_edit, None, 4.0, _edit_reference, "edit", batch_size=1, images=4),
}


def _source_images(tmp: Path, count: int) -> list[str]:
    """`count` PNG sources of a few sizes (random pixels), their absolute paths."""
    from PIL import Image

    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        w, h = (96, 64) if i % 2 else (64, 80)
        levels = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8)
        path = tmp / f"source{i}.png"
        Image.frombytes("RGB", (w, h), bytes(levels.flatten().tolist())).save(path)
        paths.append(str(path))
    return paths


def bench(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    case = CASES[name]
    steps = case.steps or args.steps
    batch = case.batch_size or args.batch_size
    count = min(case.images or args.images, args.images)
    model = case.build(tmp / name)
    edit = case.kind == "edit"
    texts = EDITS if edit else PROMPTS
    prompts = [texts[i % len(texts)] for i in range(count)]
    seeds = [7 + i for i in range(count)]
    table = {"id": [f"b{i:04d}" for i in range(count)], "prompt": prompts, "seed": seeds}
    sources = _source_images(tmp, count) if edit else []
    if edit:
        table["image"] = sources
    path = tmp / f"{name}.parquet"
    pq.write_table(pa.table(table), path)
    bucket = f"{args.size}x{args.size}"
    rows = RowConfig(
        buckets=BucketSet.from_names([bucket]),
        steps=steps,
        true_cfg_scale=case.true_cfg_scale,
        negative_prompt=NEGATIVE,
        image_column="image" if edit else None,
    )
    on = bool(args.compile)
    # The text length a job on this checkpoint gets when it names none (jobs/spec/sampling_defaults):
    # a diffusers pipeline's published one (SD3's T5 256 tokens, not ditfleet's 512), the same on
    # both sides.
    settings, text_length = PipelineSettings(), None
    if case.kind == "diffusers":
        class_name = json.loads((model / "model_index.json").read_text())["_class_name"]
        found = for_checkpoint(str(model), class_name)
        text_length = found[0].text_length() if found is not None else None
        if text_length is not None:
            settings = PipelineSettings(max_sequence_length=text_length)
    config = WorkerConfig(
        output_uri=str(tmp / f"{name}-out"),
        rows=rows,
        model_path=str(model),
        placement=ModelPlacement(device="cpu"),
        pipeline=settings,
        batch_size=batch,
        compile=CompileConfig(vae=on, dit=on, shared_cache=False),
    )
    t0 = time.perf_counter()
    worker = GenerationWorker(config)
    startup_s = time.perf_counter() - t0
    pipeline = case.reference(model, worker)
    pipeline.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]

    def call(start: int) -> None:
        part = prompts[start : start + batch]
        kwargs: dict = dict(
            prompt=part, height=args.size, width=args.size, num_inference_steps=steps, output_type="pt",
            generator=[torch.Generator().manual_seed(s) for s in seeds[start : start + batch]],
        )  # fmt: skip
        if case.kind == "diffusers":  # as the worker's adapter calls it (model/diffusers_pipeline)
            kwargs.update(guidance_scale=case.true_cfg_scale, max_sequence_length=text_length)
            if case.true_cfg_scale > 1:
                kwargs["negative_prompt"] = [NEGATIVE] * len(part)
        else:
            kwargs["true_cfg_scale"] = case.true_cfg_scale
            if case.true_cfg_scale > 1:
                kwargs["negative_prompt"] = [NEGATIVE] * len(part)
        if edit:
            from PIL import Image

            kwargs["image"] = [Image.open(p).convert("RGB") for p in sources[start : start + batch]]
        pipeline(**kwargs)  # type: ignore[operator]

    def bare() -> float:
        t = time.process_time()
        for start in range(0, count, batch):
            with torch.no_grad():
                call(start)
        return (time.process_time() - t) / count

    def job(index: int) -> float:
        t = time.process_time()
        result = worker.run_shard(ShardSpec(index, str(path), 0, count, 0, (bucket,), count))
        assert result.images_ok == count, result
        return (time.process_time() - t) / count

    call(0)  # both paths warm (allocator, first-call costs) before timing; the worker warmed at start-up
    bare_s, job_s = bare(), job(0)
    return {
        "pipeline": name,
        "family": model_family(model).name,
        "size": bucket,
        "steps": steps,
        "true_cfg_scale": case.true_cfg_scale,
        "batch_size": batch,
        "images": count,
        "bare_cpu_s_per_image": round(bare_s, 4),
        "job_cpu_s_per_image": round(job_s, 4),
        "ratio": round(job_s / bare_s, 3),
        "startup_s": round(startup_s, 2),
        "compile": worker.startup["compile"]["status"],
        "warmup_s_per_bucket": worker.startup["warmup_s"],
    }


def _report(r: dict) -> None:
    print(
        f"{r['pipeline']} ({r['family']}) at {r['size']}, {r['steps']} steps, CFG {r['true_cfg_scale']}, "
        f"batch {r['batch_size']}, {r['images']} images"
    )
    bare_ms, job_ms = r["bare_cpu_s_per_image"] * 1000, r["job_cpu_s_per_image"] * 1000
    print(f"  bare diffusers loop : {bare_ms:8.1f} ms CPU per image")
    print(f"  ditfleet worker     : {job_ms:8.1f} ms CPU per image   ratio {r['ratio']:.3f}")
    print(f"  start-up {r['startup_s']:.1f} s; warm-up per bucket {r['warmup_s_per_bucket']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--pipeline", default="all", help=f"'all' or a comma-separated list of {', '.join(CASES)}"
    )
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="the steps of every pipeline but the few-step one")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument(
        "--compile", action="store_true", help="compile blocks and decoder (inductor) at start-up"
    )
    args = ap.parse_args()

    names = list(CASES) if args.pipeline == "all" else args.pipeline.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--pipeline: unknown {unknown}; choose 'all' or from {', '.join(CASES)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoints, inputs and outputs
        for name in names:
            results.append(r := bench(name, args, Path(tmp)))
            _report(r)
    print(json.dumps({"bench": "diffusers_family", "device": "cpu", "results": results}))


if __name__ == "__main__":
    main()
