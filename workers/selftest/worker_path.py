"""The self-test's `batch_generator` line: the worker's own path (workers.generate's BatchGenerator,
the files writer, a local store) on one small shard, against the bare CFG step and decode of the
speed lines."""

from __future__ import annotations

import hashlib
import time
import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ditfleet.model.generation.pipeline import TextToImagePipeline
from ditfleet.model.settings import MAX_SEQUENCE_LENGTH, PipelineSettings
from ditfleet.workers.selftest import vqa  # noqa: F401 - registers vqa, which this line follows
from ditfleet.workers.selftest.parts import FAMILY, make_vae, sizes
from ditfleet.workers.selftest.runner import Context, StageSkipped, stage
from ditfleet.workers.selftest.speed import full_model

if TYPE_CHECKING:
    from ditfleet.workers.generate import BatchGenerator, ImageRequest
    from ditfleet.workers.output.formats.base import ShardWriter
    from ditfleet.workers.rows import PromptRow


class RandomTextEncoder:
    """Stands in for Qwen2.5-VL (not on the node): each prompt's embeddings drawn from its own
    hash, one token per word, on the CPU, as the placed encoder returns them."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size

    def count_tokens(self, prompts: list[str], max_length: int) -> list[int]:
        return [min(max(1, len(p.split())), max_length) for p in prompts]

    def encode(
        self, prompts: list[str], max_length: int = MAX_SEQUENCE_LENGTH
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.count_tokens(list(prompts), max_length)
        embeds = torch.zeros(len(prompts), max(lengths), self.hidden_size)
        mask = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little")
            embeds[i, :n] = torch.randn(n, self.hidden_size, generator=torch.Generator().manual_seed(seed))
            mask[i, :n] = 1
        return embeds, mask


@contextmanager
def count_host_syncs(ctx: Context):
    """Blocking device syncs while the block runs: CUDA's sync debug mode warns once per sync."""
    found: dict[str, int | None] = {"syncs": None}
    if not ctx.cuda:
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found["syncs"] = sum(1 for w in caught if "synchroniz" in str(w.message).lower())


@stage("batch_generator", estimate_s=30, limit_s=90, after="vqa")
def batch_generator(ctx: Context) -> None:
    """The worker's BatchGenerator (the code a job runs, minus Ray) on one small shard at the main
    bucket, images stored by the files writer on local disk; compared with the bare CFG step.
    The rows carry the job's default negative prompt, so true CFG runs as in a default job and as
    in the bare step (a null negative turns CFG off: half the forwards)."""
    from ditfleet.workers.generate import BatchGenerator, image_requests, plan_batches

    model = full_model(ctx)
    vae = ctx.state.get("vae") or make_vae(ctx)
    scheduler = ctx.state.get("scheduler")
    if scheduler is None:
        raise StageSkipped("needs the scheduler of the correctness stage")
    encoder = RandomTextEncoder(FAMILY.text_width(model.config.to_dict()))
    pipe = TextToImagePipeline(
        model,
        vae,
        scheduler,
        encoder,
        model_id="selftest",
        settings=PipelineSettings(),
        prepare_inputs=FAMILY.prepare_inputs,
    )
    size, steps, images = sizes(ctx)[0], ctx.args.worker_steps, ctx.args.worker_images
    generator = BatchGenerator(pipe)
    requests = image_requests(_prompt_rows(size, steps, images))
    batches = plan_batches(requests, ctx.args.worker_batch, generator.count_tokens)
    writer = _shard_writer(ctx)
    t0 = time.perf_counter()
    with count_host_syncs(ctx) as syncs:
        generate_s = _generate_into(ctx, generator, batches, writer)
    stored = writer.finish()
    wall = time.perf_counter() - t0
    per_image_ms = 1000 * generate_s / images
    line: dict[str, Any] = {
        "status": "measured",
        "size": f"{size}x{size}",
        "images": images,
        "batches": len(batches),
        "steps": steps,
        "shard_wall_s": round(wall, 2),
        "ms_per_image": round(per_image_ms, 1),
        "stored": len(stored.results),
        "host_syncs": syncs["syncs"],
    }
    ctx.emit({**line, **_against_bare(ctx, per_image_ms, steps)})


def _prompt_rows(size: int, steps: int, images: int) -> list[PromptRow]:
    """`images` rows of the main bucket, prompts of growing length, the job's default negative."""
    from ditfleet.model.generation.guidance import DEFAULT_NEGATIVE_PROMPT
    from ditfleet.workers.rows import PromptRow

    return [
        PromptRow(
            id=f"p{i}", prompt=" ".join(["word"] * (20 + 3 * i)), negative_prompt=DEFAULT_NEGATIVE_PROMPT,
            seed=i, width=size, height=size, requested_width=None, requested_height=None,
            bucket=f"{size}x{size}", steps=steps, true_cfg_scale=4.0, num_images=1, file="selftest", row=i,
        )
        for i in range(images)
    ]  # fmt: skip


def _shard_writer(ctx: Context) -> ShardWriter:
    from ditfleet.workers.output.formats import ShardWriterConfig, make_shard_writer
    from ditfleet.workers.output.layout import new_attempt_token
    from ditfleet.workers.storage.local import LocalStore

    assert ctx.scratch is not None
    store = LocalStore(str(ctx.scratch / "shard"))
    return make_shard_writer(store, 0, ShardWriterConfig(), new_attempt_token(0))


def _generate_into(
    ctx: Context, generator: BatchGenerator, batches: list[list[ImageRequest]], writer: ShardWriter
) -> float:
    """Every image of `batches` made and handed to `writer`; the seconds the generator took."""
    from ditfleet.workers.generate import iter_generated
    from ditfleet.workers.output.formats import ImageTask

    generate_s = 0.0
    for image in iter_generated(generator, batches):
        ctx.check("batch generator")
        generate_s += image.generate_s
        req = image.request
        assert image.pixels is not None, image.error
        writer.add(
            ImageTask(
                id=req.row.id,
                k=req.k,
                prompt=req.row.prompt,
                negative_prompt=req.row.negative_prompt,
                seed=req.seed,
            ),
            image.pixels.permute(1, 2, 0).numpy(),
        )
    return generate_s


def _against_bare(ctx: Context, per_image_ms: float, steps: int) -> dict[str, float]:
    """The worker's ms per image against the bare loop's (the CFG step's `steps` times and one
    decode), and images per hour at 50 steps; nothing without the cfg_step and vae_decode lines."""
    step = ctx.state.get("cfg_step_ms", {}).get("cfg")
    decode = ctx.state.get("decode_ms")
    if not (step and decode):
        return {}
    bare = steps * step + decode
    # 50 steps through the worker: its per-step cost scaled, the decode once.
    per_step = max(per_image_ms - decode, 1e-3) / steps
    return {
        "bare_ms_per_image": round(bare, 1),
        "overhead_vs_bare": round(per_image_ms / bare, 3),
        "images_per_hour_50_steps": round(3_600_000 / (50 * per_step + decode), 1),
    }
