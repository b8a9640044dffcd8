"""The bundled tiny model's edit variant: its text DiT fine-tuned to edit, saved as a
Qwen-Image-Edit-Plus checkpoint.

    python -m recipes.tiny.train_edit --out model/tiny/edit_weights

Data: pairs of the tiny model's own scenes (`model.tiny.edits`): a source, an instruction that
changes one attribute ("make the shape blue", "make the background yellow", "make the shape a
triangle", "make the shape large", "move the shape to the top left"), and the target that keeps
everything else. Sources are drawn from the training scenes only (the 64 held-out scenes are the
adherence check's sources; a target may be any scene), at their cells' centres where the tiny
model draws them, rounded to 8 bits as a decoded file is. Every scene is encoded once per bucket
and pairs are drawn from that table at every step.

Model: the text model's DiT and text encoder, fine-tuned together by flow matching on the
target's latents, with the source's latents (the same VAE's posterior means, normalised, packed,
at the target's size) as extra image tokens after the target's, as Qwen-Image-Edit feeds them.
The text encoder's vocabulary gains the instruction words (`edits.INSTRUCTION_WORDS`); its new
rows start random. Instructions are dropped to " " 10% of the time (the source stays), so true
CFG has an unconditional branch. The EMA of the weights is what is saved.

Output: transformer/, text_encoder/, tokenizer/, scheduler/ and model_index.json
(`QwenImageEditPlusPipeline`) in `--out`, with `vae` a relative link to the text model's vae/
(the edit model encodes and decodes with the same VAE, so the repository holds it once), and
train_log.txt with every loss and time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ditfleet.model.generation.sampling import pack_latents
from ditfleet.model.generation.scheduler import SchedulerConfig
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.model.qwen_image.edit import SOURCE_AREA_KEY, source_size
from ditfleet.model.qwen_image.loader import load_pipeline
from ditfleet.model.qwen_image.transformer import QwenImageTransformer
from ditfleet.model.qwen_image.vae import QwenImageVAE, load_vae
from ditfleet.model.tiny.edits import INSTRUCTION_WORDS, apply_edit, render_pairs, sample_edits
from ditfleet.model.tiny.scenes import TINY_BUCKETS, Scene, all_scenes, render_batch, split_scenes
from ditfleet.model.tiny.text_encoder import TinyTextEncoder, WordTokenizer
from recipes.tiny.data_parallel import SINGLE_PROCESS, Shard, run_data_parallel
from recipes.tiny.train import MODEL_INDEX, SCHEDULER_CONFIG, TrainLog, _save_fp16
from recipes.tiny.train_dit import FlowMatchingConfig, Joint, JointTrainer, LossLog, shape_token_weights

# A scene's row in every `SceneLatents` table.
_SCENE_ROW = {scene: i for i, scene in enumerate(all_scenes())}
# The source area it is fine-tuned at: its buckets' (each source at its target's size).
SOURCE_AREA = TINY_BUCKETS[0][0] * TINY_BUCKETS[0][1]
EDIT_MODEL_INDEX = {**MODEL_INDEX, "_class_name": "QwenImageEditPlusPipeline", SOURCE_AREA_KEY: SOURCE_AREA}
# What the edit model shares with the text model, linked rather than copied.
SHARED_COMPONENTS = ("vae",)


@dataclasses.dataclass(frozen=True)
class EditTrainConfig:
    seed: int = 0
    processes: int = 2
    threads: int = 1
    # A fine-tune: fewer steps at half the text stage's peak rate, a shorter EMA. The shape weight
    # covers the source's shape too (a move or a resize changes both places).
    flow: FlowMatchingConfig = FlowMatchingConfig(
        steps=700, batch_size=32, lr=3e-4, warmup=50, ema_decay=0.995
    )


@dataclasses.dataclass
class SceneLatents:
    """Every scene (`scenes.all_scenes` order) of one bucket, centred, rounded to 8 bits and
    encoded: tokens (S, h*w, 64), packed normalised posterior means. An edit pair is two rows."""

    width: int
    height: int
    tokens: torch.Tensor

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // 16, self.width // 16


def as_decoded(images: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] rounded to 8 bits: what a source looks like once written and read back."""
    return (images * 255.0).round() / 255.0


@torch.no_grad()
def encode_tokens(vae: QwenImageVAE, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> packed normalised posterior means (B, H/16 * W/16, 64)."""
    return pack_latents(vae.normalize(vae.encode(images * 2.0 - 1.0)))


def encode_scenes(vae: QwenImageVAE, shard: Shard = SINGLE_PROCESS) -> list[SceneLatents]:
    """Every scene once per bucket, each process encoding every `world`-th and all of them
    receiving the whole table. Encoded once, any number of pairs are drawn from it: a pair's
    source and target are both scenes, at the cell's centre where the tiny model draws them."""
    scenes = all_scenes()
    mine = list(range(shard.rank, len(scenes), shard.world))
    latents = []
    for width, height in TINY_BUCKETS:
        parts = [
            encode_tokens(vae, as_decoded(render_batch([scenes[i] for i in mine[s : s + 64]], width, height)))
            for s in range(0, len(mine), 64)
        ]
        part = torch.cat(parts)
        table = torch.zeros(len(scenes), *part.shape[1:])
        table[shard.rank :: shard.world] = part
        latents.append(SceneLatents(width, height, shard.sum(table)))
    return latents


@dataclasses.dataclass
class EditBatch:
    """A batch of one bucket: target tokens and source tokens (B, h*w, 64), instruction ids and
    mask (B, T), per-token loss weights (B, h*w)."""

    targets: torch.Tensor
    sources: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor


def edit_batch(
    latents: SceneLatents,
    scenes: list[Scene],
    text_encoder: TinyTextEncoder,
    size: int,
    config: FlowMatchingConfig,
    generator: torch.Generator,
) -> EditBatch:
    """`size` random edits of sources drawn from `scenes` (`edits.sample_edits`), from the table."""
    pairs = sample_edits(scenes, size, generator)
    row = _SCENE_ROW
    sources = [row[scene] for scene, _ in pairs]
    targets = [row[apply_edit(scene, edit)] for scene, edit in pairs]
    src, tgt = render_pairs(pairs, latents.width, latents.height)
    ids, mask = text_encoder.tokenize([edit.instruction for _, edit in pairs], config.max_text_tokens)
    return EditBatch(
        latents.tokens[targets],
        latents.tokens[sources],
        ids,
        mask,
        shape_token_weights(tgt, config.shape_weight, src),
    )


def edit_forward(
    transformer: QwenImageTransformer,
    tokens: torch.Tensor,
    sources: torch.Tensor,
    text: torch.Tensor,
    mask: torch.Tensor,
    sigmas: torch.Tensor,
    grid: tuple[int, int],
    source_grid: tuple[int, int],
) -> torch.Tensor:
    """The DiT's edit forward: the target's noisy tokens (B, N, 64) with the source's (B, M, 64)
    after them, one grid each, the source at the next frame; the target's velocity (B, N, 64)."""
    shapes = [[(1, *grid), (1, *source_grid)]] * tokens.shape[0]
    return transformer(torch.cat([tokens, sources], dim=1), text, mask, sigmas, shapes)


class _EditJoint(Joint):
    """The text stage's joint module, its forward the edit one."""

    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, sigmas: torch.Tensor,
        sources: torch.Tensor, grid: tuple[int, int],
    ) -> torch.Tensor:  # fmt: skip
        text = self.text_encoder(ids, mask)
        return edit_forward(self.transformer, tokens, sources, text, mask, sigmas, grid, grid)


def check_source_sizes() -> None:
    """Each bucket's sources are encoded at the bucket's size, as the pipeline resizes a source of
    that size at `SOURCE_AREA` (model.qwen_image.edit.source_size): training sees what it runs."""
    for width, height in TINY_BUCKETS:
        if source_size(width, height, SOURCE_AREA) != (width, height):
            raise ValueError(
                f"a {width}x{height} source is encoded at {source_size(width, height, SOURCE_AREA)}"
            )


def train_edit(
    config: FlowMatchingConfig,
    latents: list[SceneLatents],
    scenes: list[Scene],
    transformer: QwenImageTransformer,
    text_encoder: TinyTextEncoder,
    scheduler: SchedulerConfig,
    generator: torch.Generator,
    log: Callable[[str], None] = print,
    shard: Shard = SINGLE_PROCESS,
) -> tuple[QwenImageTransformer, TinyTextEncoder]:
    """Fine-tune both on edits of `scenes` (the buckets of `latents` taking turns); the EMA
    transformer and text encoder, in eval mode."""
    batch_size = shard.part(config.batch_size, "edit batch size")
    joint = _EditJoint(text_encoder, transformer).requires_grad_(True)
    trainer = JointTrainer(joint, config, scheduler, generator, shard)
    losses = LossLog("edit", [(t.width, t.height) for t in latents], 0.95, 50, log)
    for step in range(config.steps):
        b = step % len(latents)
        batch = edit_batch(latents[b], scenes, text_encoder, batch_size, config, generator)
        forward = functools.partial(joint, sources=batch.sources, grid=latents[b].grid)
        loss = trainer.step(step, forward, batch.targets, batch.ids, batch.mask, batch.weights)
        losses.add(step, b, loss, step == config.steps - 1, trainer.lr)
    return trainer.trained()


def load_text_model(root: Path) -> tuple[QwenImageTransformer, TinyTextEncoder, QwenImageVAE]:
    """The text model's DiT and text encoder (fp32) and its VAE with the encoder."""
    pipe = load_pipeline(root, modulation_cache="off")  # training computes every modulation
    if not isinstance(pipe.text_encoder, TinyTextEncoder):
        raise ValueError(f"{root}: its text encoder is not the tiny one; start from the tiny text model.")
    return pipe.transformer, pipe.text_encoder, load_vae(root / "vae", with_encoder=True)


def extend_vocabulary(text_encoder: TinyTextEncoder, words: tuple[str, ...], seed: int) -> TinyTextEncoder:
    """The same encoder with `words` added to its vocabulary (new ids after the old ones, so every
    known word keeps its id and embedding); each new row random at the old rows' scale."""
    vocab = dict(text_encoder.tokenizer.vocab)
    for word in words:
        vocab.setdefault(word, len(vocab))
    tokenizer = WordTokenizer(vocab)
    config = dataclasses.replace(text_encoder.config, vocab_size=len(vocab))
    extended = TinyTextEncoder(config, tokenizer)
    state = text_encoder.state_dict()
    old = state["embed.weight"]
    new = torch.randn(len(vocab) - old.shape[0], old.shape[1], generator=torch.Generator().manual_seed(seed))
    state["embed.weight"] = torch.cat([old, new * old.std()])
    extended.load_state_dict(state, strict=True)
    return extended


def save_edit_model(
    out: Path, transformer: QwenImageTransformer, text_encoder: TinyTextEncoder, text_model: Path
) -> None:
    """Write the edit model's own parts to `out` and link the text model's shared ones."""
    out.mkdir(parents=True, exist_ok=True)
    _save_fp16(transformer.state_dict(), transformer.config.to_dict(), out / "transformer")
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(SCHEDULER_CONFIG, indent=2, sort_keys=True)
    )
    text_encoder.save(out)
    (out / "model_index.json").write_text(json.dumps(EDIT_MODEL_INDEX, indent=2, sort_keys=True))
    for name in SHARED_COMPONENTS:
        link = out / name
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            shutil.rmtree(link)
        link.symlink_to(os.path.relpath(text_model / name, out), target_is_directory=True)


def train(
    config: EditTrainConfig, out: Path, text_model: Path = TINY_MODEL_DIR, start_from: Path | None = None
) -> float:
    """Fine-tune and save to `out` over `config.processes` processes; the wall time in seconds.

    start_from: an edit model this recipe saved, to fine-tune further (a second stage with its
    own schedule; its train_log.txt is continued in `out`)."""
    start = time.time()
    if start_from is not None and start_from.resolve() != out.resolve():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(start_from / "train_log.txt", out / "train_log.txt")
    run_data_parallel(
        config.processes, functools.partial(_train_in_process, config, out, text_model, start_from)
    )
    return time.time() - start


def _train_in_process(
    config: EditTrainConfig, out: Path, text_model: Path, start_from: Path | None, shard: Shard
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = TrainLog(out / "train_log.txt", shard.is_main, append=start_from is not None)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    start, cpu_start = time.time(), time.process_time()
    train_scenes, held_out = split_scenes()
    log(f"config {json.dumps(dataclasses.asdict(config))}")
    log(
        f"edit fine-tune of {start_from or text_model}: sources from {len(train_scenes)} training scenes ({len(held_out)} held out); "
        f"torch {torch.__version__}, {config.processes} processes of {config.threads} threads"
    )
    check_source_sizes()
    transformer, text_encoder, vae = load_text_model(start_from or text_model)
    text_encoder = extend_vocabulary(text_encoder, INSTRUCTION_WORDS, config.seed)  # once: known words stay
    latents = encode_scenes(vae, shard)
    log(f"scene latents: {[tuple(t.tokens.shape) for t in latents]} at {time.time() - start:.0f}s")
    generator = shard.generator(config.seed + 3)
    scheduler = SchedulerConfig.from_dict(SCHEDULER_CONFIG)
    transformer, text_encoder = train_edit(
        config.flow, latents, train_scenes, transformer, text_encoder, scheduler, generator, log, shard
    )
    if not shard.is_main:
        return
    save_edit_model(out, transformer, text_encoder, text_model)
    own = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and not _under_link(f, out))
    elapsed, cpu = time.time() - start, time.process_time() - cpu_start
    log(
        f"saved to {out} ({own / 1e6:.1f} MB of its own; {', '.join(SHARED_COMPONENTS)} linked to {text_model}); "
        f"total training time {elapsed:.0f}s ({elapsed / 60:.1f} min) wall, {cpu:.0f} CPU-seconds in process 0"
    )
    log.close()


def _under_link(path: Path, root: Path) -> bool:
    return any((root / part).is_symlink() for part in path.relative_to(root).parts[:1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fine-tune the bundled tiny model's DiT to edit its scenes.")
    parser.add_argument("--out", type=Path, required=True, help="output model folder")
    parser.add_argument(
        "--text-model", type=Path, default=TINY_MODEL_DIR, help="the text model it starts from"
    )
    parser.add_argument(
        "--start-from",
        type=Path,
        default=None,
        help="an edit model saved by this recipe, to fine-tune further",
    )
    defaults = EditTrainConfig()
    knobs = [(f.name, defaults) for f in dataclasses.fields(EditTrainConfig) if f.name != "flow"]
    knobs += [(f.name, defaults.flow) for f in dataclasses.fields(FlowMatchingConfig)]
    for name, owner in knobs:
        value = getattr(owner, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    config = EditTrainConfig(
        **{name: getattr(args, name) for name, owner in knobs if owner is defaults},
        flow=FlowMatchingConfig(
            **{name: getattr(args, name) for name, owner in knobs if owner is not defaults}
        ),
    )
    train(config, args.out, args.text_model, args.start_from)


if __name__ == "__main__":
    main()
