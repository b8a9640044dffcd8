"""Train the bundled tiny text-to-image model from scratch and save it in the diffusers layout.

    python -m recipes.tiny.train --out model/tiny/weights

Stages: (1) the VAE as an autoencoder on procedural scenes, with its latent statistics measured
after training; (2) the DiT and the text encoder jointly, by flow matching on VAE latents of the
training captions (the 64 held-out captions are never seen); (3) the VAE decoder adapted to the
latents the trained DiT samples (recipes/tiny/train_decoder.py). Everything is seeded: the same
command on the same software gives the same weights. It runs as two data-parallel processes
(one per core of a 2-core machine; `--processes`).

Output (safetensors, fp16 on disk like the released Qwen-Image, loaded in any dtype):
transformer/, vae/ (diffusers' AutoencoderKLQwenImage 3D layout), scheduler/, text_encoder/,
tokenizer/, model_index.json, and train_log.txt with the losses and times. vae/decoder_adaptation.json
records stage 3's settings (and that the decoder is no longer the VAE stage's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from ditfleet.model.generation.scheduler import SchedulerConfig
from ditfleet.model.qwen_image.loader import load_pipeline
from ditfleet.model.qwen_image.transformer import QwenImageTransformer
from ditfleet.model.qwen_image.vae import QwenImageVAE, load_vae, vae_state_dict_3d
from ditfleet.model.tiny.scenes import all_scenes, split_scenes
from ditfleet.model.tiny.text_encoder import TextEncoderConfig, TinyTextEncoder, WordTokenizer
from recipes.tiny.data_parallel import Shard, run_data_parallel
from recipes.tiny.train_decoder import DecoderTrainConfig, adapt_decoder
from recipes.tiny.train_dit import DiTTrainConfig, build_centred_pools, build_pools, train_dit
from recipes.tiny.train_vae import VAETrainConfig, reconstruction_error, train_vae

# Qwen-Image's scheduler settings, in diffusers' FlowMatchEulerDiscreteScheduler spelling.
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
MODEL_INDEX = {
    "_class_name": "QwenImagePipeline",
    "_diffusers_version": "0.35.0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["ditfleet.model.tiny.text_encoder", "TinyTextEncoder"],
    "tokenizer": ["ditfleet.model.tiny.text_encoder", "WordTokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
SAVE_DTYPE = torch.float16
TEXT_HIDDEN = 64
# Written into vae/ by stage 3: the decoder there is adapted to a DiT, not the VAE stage's own.
DECODER_ADAPTATION_FILE = "decoder_adaptation.json"


@dataclasses.dataclass(frozen=True)
class TinyTrainConfig:
    seed: int = 0
    # Data-parallel processes (one per core) and torch threads in each.
    processes: int = 2
    threads: int = 1
    vae: VAETrainConfig = VAETrainConfig()
    dit: DiTTrainConfig = DiTTrainConfig()
    decoder: DecoderTrainConfig = DecoderTrainConfig()


def caption_vocabulary() -> list[str]:
    """Every word of every caption (held-out ones included: a vocabulary is not training data)."""
    words = {w for s in all_scenes() for w in re.findall(r"[a-z0-9]+", s.caption)}
    return sorted(words | {"center", "an"})


def _save_fp16(state: dict[str, torch.Tensor], config: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = {
        k: (v.to(SAVE_DTYPE) if v.is_floating_point() else v).contiguous().cpu() for k, v in state.items()
    }
    save_file(state, str(out_dir / "diffusion_pytorch_model.safetensors"))


def save_model(
    out: Path, transformer: QwenImageTransformer, vae: QwenImageVAE, text_encoder: TinyTextEncoder
) -> None:
    """Write the whole model folder in the diffusers layout."""
    out.mkdir(parents=True, exist_ok=True)
    _save_fp16(transformer.state_dict(), transformer.config.to_dict(), out / "transformer")
    _save_fp16(vae_state_dict_3d(vae), vae.config.to_dict(), out / "vae")
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(SCHEDULER_CONFIG, indent=2, sort_keys=True)
    )
    text_encoder.save(out)
    (out / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2, sort_keys=True))


class TrainLog:
    """Process 0's training log: each line printed and written to `path` at once (a run stopped
    midway keeps what it logged); other processes log nothing."""

    def __init__(self, path: Path, is_main: bool, append: bool = False) -> None:
        self._file = path.open("a" if append else "w") if is_main else None

    def __call__(self, line: str) -> None:
        if self._file is not None:
            print(line, flush=True)
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def decoder_is_adapted(vae_dir: Path) -> bool:
    return (vae_dir / DECODER_ADAPTATION_FILE).is_file()


def train(
    config: TinyTrainConfig, out: Path, vae_dir: Path | None = None, stage2_dir: Path | None = None
) -> float:
    """Train everything and save to `out`, over `config.processes` data-parallel processes; returns
    the wall time in seconds.

    vae_dir: a `vae/` folder saved by an earlier run with the same seed and VAE settings (and no
    decoder adaptation), to skip the VAE stage (the result is the same as training it).
    stage2_dir: a model folder saved by an earlier run with the same settings and
    `decoder.steps == 0`, to run only stage 3 on it (the result is the same as the whole recipe)."""
    start = time.time()
    if stage2_dir is not None and stage2_dir.resolve() != out.resolve():
        # Stage 3 rewrites vae/ only; everything else (and the log, which it extends) comes along.
        shutil.copytree(stage2_dir, out, dirs_exist_ok=True)
    run_data_parallel(
        config.processes, functools.partial(_train_in_process, config, out, vae_dir, stage2_dir)
    )
    return time.time() - start


def _train_in_process(
    config: TinyTrainConfig, out: Path, vae_dir: Path | None, stage2_dir: Path | None, shard: Shard
) -> None:
    """One training process: every process trains, process 0 also logs and saves."""
    out.mkdir(parents=True, exist_ok=True)
    log = TrainLog(out / "train_log.txt", shard.is_main, append=stage2_dir is not None)
    torch.set_num_threads(config.threads)
    # Same weights in every process: the initialisation draws from the global seed.
    torch.manual_seed(config.seed)
    train_scenes, held_out = split_scenes()
    log(f"config {json.dumps(dataclasses.asdict(config))}")
    log(
        f"scenes: {len(train_scenes)} train captions, {len(held_out)} held out; torch {torch.__version__}, "
        f"{config.processes} processes of {config.threads} threads"
    )
    start, cpu_start = time.time(), time.process_time()

    if stage2_dir is None:
        _train_vae_and_dit(config, out, vae_dir, shard, log)
        shard.barrier()  # stage 3 reads what process 0 saved
    else:
        log(f"stages 1-2 taken from {stage2_dir} (trained by the same recipe; their training is skipped)")
    if config.decoder.steps > 0:
        torch.manual_seed(config.seed + 2)
        generator = shard.generator(config.seed + 2)
        # Stage 3 starts from the saved (fp16-rounded) stage-2 model in either case, so reusing a
        # saved one gives the same decoder as running straight through.
        pipe = load_pipeline(out, modulation_cache="cfg")
        pipe.vae = load_vae(out / "vae", with_encoder=True)
        vae = adapt_decoder(config.decoder, pipe, train_scenes, generator, config.vae.edge_weight, log, shard)
        if shard.is_main:
            _save_fp16(vae_state_dict_3d(vae), vae.config.to_dict(), out / "vae")
            (out / "vae" / DECODER_ADAPTATION_FILE).write_text(
                json.dumps(dataclasses.asdict(config.decoder), indent=2, sort_keys=True)
            )
        log(f"stage decoder done at {time.time() - start:.0f}s")
    if not shard.is_main:
        return
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    elapsed = time.time() - start
    cpu = time.process_time() - cpu_start
    # CPU seconds over threads ~ the wall time on an otherwise idle machine (the wall time includes
    # whatever else shares the cores).
    log(
        f"saved to {out} ({total / 1e6:.1f} MB); total training time {elapsed:.0f}s ({elapsed / 60:.1f} min) wall, "
        f"{cpu:.0f} CPU-seconds in process 0 ({cpu / config.threads / 60:.1f} min on {config.threads} idle cores "
        f"for each of the {config.processes} processes)"
    )
    log.close()


def _train_vae_and_dit(
    config: TinyTrainConfig, out: Path, vae_dir: Path | None, shard: Shard, log: Callable[[str], None]
) -> None:
    """Stages 1 and 2; process 0 saves the model to `out`."""
    start = time.time()
    generator = shard.generator(config.seed)
    train_scenes, _ = split_scenes()
    if vae_dir is None:
        vae = train_vae(config.vae, train_scenes, generator, log, shard)
        if shard.is_main:  # only process 0 logs it
            error = reconstruction_error(vae, train_scenes, 32, generator)
            log(f"vae reconstruction L1 (0..1 units, 128x128): {error:.4f}")
        # The DiT learns the latents of the VAE that ships, i.e. with its weights rounded to the
        # saved dtype; a VAE loaded back from the saved folder is then the same one.
        with torch.no_grad():
            for t in vae.state_dict().values():
                if t.is_floating_point():
                    t.copy_(t.to(SAVE_DTYPE))
        log(f"stage vae done at {time.time() - start:.0f}s")
    else:
        vae = load_vae(vae_dir, with_encoder=True)
        log(f"vae loaded from {vae_dir} (trained by the same VAE stage; its training is skipped)")

    # The DiT stage starts from its own seeds, so it depends on the VAE's weights only, not on how
    # many random numbers the VAE stage drew: reusing a trained VAE gives the same DiT.
    torch.manual_seed(config.seed + 1)
    generator = shard.generator(config.seed + 1)
    tokenizer = WordTokenizer.from_words(caption_vocabulary())
    text_encoder = TinyTextEncoder(
        TextEncoderConfig(vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN), tokenizer
    )
    pools = build_pools(vae, text_encoder, train_scenes, config.dit, generator, shard)
    centred = (
        build_centred_pools(vae, text_encoder, train_scenes, config.dit, shard)
        if config.dit.centre_from_step
        else None
    )
    log(f"latent pools per process: {[tuple(p.tokens.shape) for p in pools]} at {time.time() - start:.0f}s")
    scheduler = SchedulerConfig.from_dict(SCHEDULER_CONFIG)
    transformer, text_encoder = train_dit(
        config.dit, pools, text_encoder, scheduler, generator, log, centred_pools=centred, shard=shard
    )
    log(f"stage dit done at {time.time() - start:.0f}s")
    if shard.is_main:
        save_model(out, transformer, vae, text_encoder)
        # A reused VAE keeps its record: an adapted decoder must not pass for the VAE stage's.
        marker = out / "vae" / DECODER_ADAPTATION_FILE
        if vae_dir is not None and decoder_is_adapted(vae_dir):
            shutil.copyfile(vae_dir / DECODER_ADAPTATION_FILE, marker)
        else:
            marker.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Train the bundled tiny model (procedural shapes) from scratch."
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "weights", help="output model folder"
    )
    # (flag, type, default, help) of every number the recipe lets a run change.
    options = (
        ("--seed", int, TinyTrainConfig.seed, "seed of every random draw"),
        ("--processes", int, TinyTrainConfig.processes,
         "data-parallel training processes, one per core (the batches split evenly over them)"),
        ("--threads", int, TinyTrainConfig.threads,
         "torch CPU threads in each process (a second thread does not speed up these small layers; a second process does)"),
        ("--vae-steps", int, VAETrainConfig.steps, "VAE training steps"),
        ("--vae-stats-images", int, VAETrainConfig.stats_images,
         "images the VAE's per-channel latent mean and std are measured on"),
        ("--dit-steps", int, DiTTrainConfig.steps, "DiT training steps"),
        ("--pool-per-bucket", int, DiTTrainConfig.pool_per_bucket, "images encoded per bucket for the DiT"),
        ("--dit-centre-from", int, DiTTrainConfig.centre_from_step,
         "DiT step from which the shapes are at their cells' centres (0: jittered throughout)"),
        ("--dit-shape-weight", float, DiTTrainConfig.shape_weight,
         "DiT loss weight of the tokens holding the shape, relative to background tokens"),
        ("--dit-heads", int, DiTTrainConfig.num_attention_heads,
         "DiT attention heads (width = heads x attention_head_dim)"),
        ("--dit-layers", int, DiTTrainConfig.num_layers, "DiT blocks"),
        ("--dit-batch", int, DiTTrainConfig.batch_size, "DiT batch size (split over the processes)"),
        ("--decoder-steps", int, DecoderTrainConfig.steps,
         "decoder adaptation steps (0: no stage 3, the decoder stays the VAE stage's)"),
        ("--decoder-pairs", int, DecoderTrainConfig.pairs_per_bucket,
         "DiT samples per bucket the decoder adapts to"),
    )  # fmt: skip
    for flag, kind, default, help_text in options:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument(
        "--vae",
        type=Path,
        default=None,
        help="reuse this vae/ folder from an earlier run with the same --seed, --vae-steps and --vae-stats-images (skips the VAE stage)",
    )
    parser.add_argument(
        "--stage2",
        type=Path,
        default=None,
        help="run only stage 3 on this model folder, saved by an earlier run with the same settings and --decoder-steps 0",
    )
    args = parser.parse_args(argv)
    config = TinyTrainConfig(
        seed=args.seed,
        processes=args.processes,
        threads=args.threads,
        vae=dataclasses.replace(VAETrainConfig(), steps=args.vae_steps, stats_images=args.vae_stats_images),
        dit=dataclasses.replace(
            DiTTrainConfig(),
            steps=args.dit_steps,
            pool_per_bucket=args.pool_per_bucket,
            centre_from_step=args.dit_centre_from,
            shape_weight=args.dit_shape_weight,
            num_attention_heads=args.dit_heads,
            num_layers=args.dit_layers,
            batch_size=args.dit_batch,
        ),
        decoder=dataclasses.replace(
            DecoderTrainConfig(), steps=args.decoder_steps, pairs_per_bucket=args.decoder_pairs
        ),
    )
    if args.vae is not None and not (args.vae / "config.json").is_file():
        parser.error(f"--vae {args.vae}: no config.json there; pass the vae/ folder of a trained model.")
    if args.vae is not None and decoder_is_adapted(args.vae) and args.decoder_steps:
        parser.error(
            f"--vae {args.vae}: its decoder was already adapted to a DiT ({DECODER_ADAPTATION_FILE}); pass a "
            "vae/ saved with --decoder-steps 0, or add --decoder-steps 0 to train only the DiT."
        )
    if args.stage2 is not None:
        if args.vae is not None:
            parser.error("--stage2 takes the VAE from that folder too; drop --vae.")
        if not (args.stage2 / "transformer" / "config.json").is_file():
            parser.error(f"--stage2 {args.stage2}: no transformer/config.json there; pass a model folder.")
        if decoder_is_adapted(args.stage2 / "vae"):
            parser.error(
                f"--stage2 {args.stage2}: its decoder is already adapted ({DECODER_ADAPTATION_FILE} in vae/); "
                "pass a model saved with --decoder-steps 0."
            )
        if args.decoder_steps == 0:
            parser.error("--stage2 with --decoder-steps 0 would train nothing; give stage 3 some steps.")
    train(config, args.out, args.vae, args.stage2)


if __name__ == "__main__":
    main()
