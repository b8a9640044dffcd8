"""Stage 2 of the tiny model: the Qwen-Image DiT (our class, tiny config) and the text encoder, jointly,
with rectified-flow (flow-matching) training on VAE latents.

x_s = (1 - s) * x0 + s * noise, and the transformer predicts the velocity noise - x0 at timestep s
(the sampler's sigma; the model takes t / 1000 = s). s is logit-normal, then shifted with the
scheduler's own exponential shift for the bucket's token count, so training spends its effort
where the sampler will ask. Captions are dropped to the negative prompt " " 10% of the time so that
true CFG has an unconditional branch to guide against. An EMA of the weights is what gets saved.

Latents come from a pool encoded once (posterior means, normalised with the VAE's statistics,
packed 2x2), one pool per resolution bucket; batches take turns over the buckets.

Two phases (`centre_from_step`). The DiT has no absolute position embedding: an image token learns
where it is only through RoPE's relative phase to the caption's tokens, and that routing ("top left"
-> these tokens) is what takes longest to learn. It is learned from images with the shape jittered
inside its cell (a smooth target at high noise): position was right in 95% of held-out images
after 2,000 steps, while with every shape at its cell's centre from the start, or with 40% of the
sigmas drawn uniformly instead of from the logit-normal, the DiT still predicted an empty
background at high noise after 2,000-4,000 steps. The second phase then trains on shapes at their
cells' centres, one exact outline per caption and bucket (every training caption once per
bucket); the outline keeps improving with its length (kind 27% -> 39% -> 50% on the held-out
captions at 600 / 1,200 / 3,500 steps into it, 72-78% at 3,800 with the recipe's other settings,
97-98% at 7,000; 9,000 steps in all fit the recipe in 41 minutes on the README's 2-core machine).

The loss weighs the tokens under the shape `shape_weight` times the background's. Unweighted, the
DiT drew one rounded blob for every kind, on training captions as on held-out ones (fill ratios of
squares and circles alike about 0.83): the corners that tell the kinds apart are a sliver of the
loss. With the weight, the same 3,500-step run drew the held-out kinds (CFG 4) right 50/47/39%
of the time in the three buckets instead of 37/30/28%, and its outlines overlap the ideal
0.74/0.66/0.61 instead of 0.56/0.49/0.46 (IoU).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ditfleet.model.generation.sampling import pack_latents
from ditfleet.model.generation.scheduler import SchedulerConfig, shift_mu
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from ditfleet.model.qwen_image.vae import QwenImageVAE
from ditfleet.model.tiny.scenes import TINY_BUCKETS, Scene, render_batch, sample_batch
from ditfleet.model.tiny.text_encoder import TinyTextEncoder
from recipes.tiny.data_parallel import SINGLE_PROCESS, Shard
from recipes.tiny.train_vae import lr_at


@dataclass(frozen=True)
class FlowMatchingConfig:
    """The knobs of a DiT stage's flow-matching steps (`JointTrainer`): this stage's defaults; the
    edit fine-tune (train_edit.py) sets its own."""

    steps: int = 9000
    batch_size: int = 48
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    caption_dropout: float = 0.1
    ema_decay: float = 0.998
    max_text_tokens: int = 32
    # Loss weight of the tokens that hold part of the shape, relative to plain-background tokens
    # (then normalised to a mean of 1 per image). A shape covers 2-9 of 60-64 tokens and its kind
    # lives in its corners: unweighted, the DiT learned colour, position and size but drew the
    # same rounded blob for every kind (train captions as badly as held-out ones).
    shape_weight: float = 8.0


@dataclass(frozen=True)
class DiTTrainConfig(FlowMatchingConfig):
    num_layers: int = 4
    # 128 wide. 6 heads (192 wide) fit the 45 minutes only at half the batch, and drew worse
    # outlines than this at the same wall time (held-out kind 47-61% against 67-77%).
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    axes_dims_rope: tuple[int, int, int] = (8, 12, 12)
    # Images encoded once per bucket.
    pool_per_bucket: int = 2048
    # Position jitter of the training images (1: anywhere in the free room of the cell, 0: at the
    # cell's centre, one fixed image per caption and bucket).
    jitter: float = 1.0
    # From this step on (0: never), batches come from a second set of pools with every shape at its
    # cell's centre: the jittered images teach where a caption puts the shape, the centred ones then
    # one exact outline per caption and bucket.
    centre_from_step: int = 2000

    def transformer_config(self, text_dim: int) -> TransformerConfig:
        return TransformerConfig(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=text_dim,
            axes_dims_rope=self.axes_dims_rope,
        )


@dataclass
class LatentPool:
    """Packed normalised latents of one bucket: tokens (N, h*w, 64), text ids/mask (N, T), and the
    per-token loss weights (N, h*w)."""

    width: int
    height: int
    tokens: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // 16, self.width // 16


def shape_token_weights(images: torch.Tensor, shape_weight: float, *also: torch.Tensor) -> torch.Tensor:
    """(B, H/16 * W/16) loss weights, in the packed token order: `shape_weight` on the tokens whose
    16x16 pixels touch the shape, 1 elsewhere, normalised to mean 1 per image. images: (B, 3, H, W)
    in [0, 1]; the shape never touches the border, so the corner pixel is the background. `also`:
    more images of the same size (an edit's source), whose shapes' tokens weigh the same."""
    covered = torch.zeros_like(images[:, :1], dtype=torch.bool)  # (B, 1, H, W)
    for drawn in (images, *also):
        covered |= (drawn - drawn[:, :, :1, :1]).abs().amax(dim=1, keepdim=True) > 0.02
    touched = torch.nn.functional.max_pool2d(covered.float(), kernel_size=16).flatten(1)  # (B, h*w)
    weights = 1.0 + (shape_weight - 1.0) * touched
    return weights / weights.mean(dim=1, keepdim=True)


@torch.no_grad()
def _encode_pool(
    vae: QwenImageVAE,
    text_encoder: TinyTextEncoder,
    width: int,
    height: int,
    batches: Iterable[tuple[torch.Tensor, list[str]]],
    config: DiTTrainConfig,
) -> LatentPool:
    chunks, weights, captions = [], [], []
    for images, caps in batches:
        z = vae.normalize(vae.encode(images * 2.0 - 1.0))  # (n, 16, H/8, W/8)
        chunks.append(pack_latents(z))  # (n, H/16 * W/16, 64)
        weights.append(shape_token_weights(images, config.shape_weight))
        captions += caps
    ids, mask = text_encoder.tokenize(captions, config.max_text_tokens)
    return LatentPool(width, height, torch.cat(chunks), ids, mask, torch.cat(weights))


def build_pools(
    vae: QwenImageVAE,
    text_encoder: TinyTextEncoder,
    scenes: list[Scene],
    config: DiTTrainConfig,
    generator: torch.Generator,
    shard: Shard = SINGLE_PROCESS,
) -> list[LatentPool]:
    """One pool per bucket of `config.pool_per_bucket` random scenes, jittered by `config.jitter`
    (this process's part of it, drawn from its own generator)."""
    pools = []
    total = shard.part(config.pool_per_bucket, "pool_per_bucket")
    for width, height in TINY_BUCKETS:
        sizes = [min(64, total - s) for s in range(0, total, 64)]
        batches = (sample_batch(scenes, n, width, height, generator, config.jitter) for n in sizes)
        pools.append(_encode_pool(vae, text_encoder, width, height, batches, config))
    return pools


def build_centred_pools(
    vae: QwenImageVAE,
    text_encoder: TinyTextEncoder,
    scenes: list[Scene],
    config: DiTTrainConfig,
    shard: Shard = SINGLE_PROCESS,
) -> list[LatentPool]:
    """One pool per bucket with each scene at most once, its shape at the cell's centre: every scene
    when `config.pool_per_bucket` allows (random samples with repeats left a quarter of the
    captions out of a 2,048-image pool), else a fixed random subset of that many. The processes
    of a data-parallel run take every `world`-th scene of it."""
    order = torch.randperm(len(scenes), generator=torch.Generator().manual_seed(0))
    chosen = [scenes[i] for i in order[: config.pool_per_bucket][shard.rank :: shard.world].tolist()]
    pools = []
    for width, height in TINY_BUCKETS:
        batches = (
            (render_batch(chosen[s : s + 64], width, height), [c.caption for c in chosen[s : s + 64]])
            for s in range(0, len(chosen), 64)
        )
        pools.append(_encode_pool(vae, text_encoder, width, height, batches, config))
    return pools


def sample_sigmas(
    n: int, image_seq_len: int, scheduler: SchedulerConfig, generator: torch.Generator
) -> torch.Tensor:
    """(n,) in (0, 1): logit-normal, then the scheduler's exponential shift for this token count."""
    s = torch.sigmoid(torch.randn(n, generator=generator))
    mu = shift_mu(scheduler, image_seq_len)
    return math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0))


def drop_captions(
    ids: torch.Tensor, mask: torch.Tensor, p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace a fraction p of rows by the tokens of the negative prompt " " (just <bos>)."""
    drop = torch.rand(ids.shape[0], generator=generator) < p
    ids, mask = ids.clone(), mask.clone()
    bos = ids[:, :1].clone()  # every row starts with <bos>
    ids[drop] = 0
    mask[drop] = 0
    ids[drop, 0] = bos[drop, 0]
    mask[drop, 0] = 1
    return ids, mask


class EMA:
    """Exponential moving average of a module's floating-point state, with a short warm-up."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = copy.deepcopy(module).eval().requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for s, p in zip(self.shadow.parameters(), module.parameters()):
            s.lerp_(p.detach(), 1.0 - d)


def adaln_zero_init(transformer: QwenImageTransformer) -> None:
    """Zero the modulation and output projections (DiT's adaLN-Zero): every block starts as the
    identity and the model predicts zero, which trains markedly faster than the default init."""
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for mod in (block.img_mod[1], block.txt_mod[1]):
                mod.weight.zero_()
                mod.bias.zero_()
        for linear in (transformer.norm_out.linear, transformer.proj_out):
            linear.weight.zero_()
            linear.bias.zero_()


class Joint(torch.nn.Module):
    """Text encoder + transformer as one module, so one optimizer and one EMA cover both."""

    def __init__(self, text_encoder: TinyTextEncoder, transformer: QwenImageTransformer) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.transformer = transformer

    def forward(
        self,
        tokens: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        sigmas: torch.Tensor,
        grid: tuple[int, int],
    ) -> torch.Tensor:
        text = self.text_encoder(ids, mask)  # (B, T, D_text)
        shapes = [(1, grid[0], grid[1])] * tokens.shape[0]
        return self.transformer(tokens, text, mask, sigmas, shapes)  # (B, N, 64)


class JointTrainer:
    """One optimizer and one EMA over a joint module (text encoder + DiT), and the flow-matching
    step both DiT stages take (the text DiT here, the edit fine-tune in train_edit.py).

    AdamW without weight decay on norms, biases and embeddings; each step drops a share of the
    captions to " ", samples sigmas with the scheduler's shift, noises the target, weighs the
    per-token velocity error, averages the gradients over the processes, clips them to norm 1
    and updates the EMA."""

    def __init__(
        self,
        joint: Joint,
        config: FlowMatchingConfig,
        scheduler: SchedulerConfig,
        generator: torch.Generator,
        shard: Shard,
    ) -> None:
        self.joint = joint.train()
        self.config, self.scheduler, self.generator, self.shard = config, scheduler, generator, shard
        self.ema = EMA(joint, config.ema_decay)
        decay, no_decay = [], []
        for name, p in joint.named_parameters():
            (no_decay if p.ndim < 2 or "embed" in name or "pos" in name else decay).append(p)
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=(0.9, 0.99),
        )

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def step(
        self,
        step: int,
        forward: Callable[..., torch.Tensor],
        x0: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor,
    ) -> float:
        """Step `step` (its learning rate: warm-up, then cosine) on targets x0 (B, N, 64) with their
        caption ids/mask (B, T) and per-token loss weights (B, N); forward(x_s, ids, mask, sigmas)
        -> the predicted velocity (B, N, 64). Returns the loss."""
        config, generator = self.config, self.generator
        for group in self.opt.param_groups:
            group["lr"] = lr_at(step, config.steps, config.warmup, config.lr)
        ids, mask = drop_captions(ids, mask, config.caption_dropout, generator)
        length = int(mask.sum(dim=1).max())  # trim padding every row shares
        ids, mask = ids[:, :length], mask[:, :length]
        sig = sample_sigmas(x0.shape[0], x0.shape[1], self.scheduler, generator)
        noise = torch.randn(x0.shape, generator=generator)
        x_s = (1.0 - sig[:, None, None]) * x0 + sig[:, None, None] * noise
        pred = forward(x_s, ids, mask, sig)
        loss = ((pred - (noise - x0)).pow(2).mean(dim=2) * weights).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.shard.average_gradients(list(self.joint.parameters()))
        torch.nn.utils.clip_grad_norm_(self.joint.parameters(), 1.0)
        self.opt.step()
        self.ema.update(self.joint)
        return loss.item()

    def trained(self) -> tuple[QwenImageTransformer, TinyTextEncoder]:
        """The EMA's transformer and text encoder, in eval mode."""
        shadow = self.ema.shadow
        return shadow.transformer.eval(), shadow.text_encoder.eval()


class LossLog:
    """Each bucket's running loss (an exponential average, `keep` of the old value per step),
    logged every `every` steps and at the last, with the learning rate and the time."""

    def __init__(
        self, name: str, buckets: list[tuple[int, int]], keep: float, every: int, log: Callable[[str], None]
    ) -> None:
        self.name, self.buckets, self.keep, self.every, self.log = name, buckets, keep, every, log
        self.running: list[float | None] = [None] * len(buckets)
        self.start = time.time()

    def add(self, step: int, bucket: int, loss: float, last: bool, lr: float) -> None:
        old = self.running[bucket]
        self.running[bucket] = loss if old is None else self.keep * old + (1.0 - self.keep) * loss
        if step % self.every == 0 or last:
            per_bucket = "  ".join(
                f"{w}x{h} {r:.4f}" for (w, h), r in zip(self.buckets, self.running) if r is not None
            )
            self.log(
                f"{self.name} step {step:5d}  loss {per_bucket}  lr {lr:.2e}  {time.time() - self.start:6.0f}s"
            )


def train_dit(
    config: DiTTrainConfig,
    pools: list[LatentPool],
    text_encoder: TinyTextEncoder,
    scheduler: SchedulerConfig,
    generator: torch.Generator,
    log: Callable[[str], None] = print,
    centred_pools: list[LatentPool] | None = None,
    shard: Shard = SINGLE_PROCESS,
) -> tuple[QwenImageTransformer, TinyTextEncoder]:
    """Returns the EMA transformer and text encoder, in eval mode. `centred_pools` (same buckets as
    `pools`) replace `pools` from `config.centre_from_step` on. Over several processes (`shard`),
    each trains on its part of the batch, drawn from its own pools and generator."""
    batch_size = shard.part(config.batch_size, "DiT batch size")
    if config.centre_from_step and centred_pools is None:
        raise ValueError("train_dit: config.centre_from_step is set but no centred_pools were given.")
    transformer = QwenImageTransformer(config.transformer_config(text_encoder.hidden_size))
    adaln_zero_init(transformer)
    trainer = JointTrainer(Joint(text_encoder, transformer), config, scheduler, generator, shard)
    losses = LossLog("dit", [(p.width, p.height) for p in pools], 0.98, 100, log)
    for step in range(config.steps):
        b = step % len(pools)
        centred_phase = bool(config.centre_from_step) and step >= config.centre_from_step
        pool = (centred_pools if centred_phase else pools)[b]
        idx = torch.randint(pool.tokens.shape[0], (batch_size,), generator=generator)
        forward = functools.partial(trainer.joint, grid=pool.grid)
        x0, ids, mask, weights = pool.tokens[idx], pool.ids[idx], pool.mask[idx], pool.weights[idx]
        loss = trainer.step(step, forward, x0, ids, mask, weights)  # x0: (B, N, 64)
        losses.add(step, b, loss, step == config.steps - 1, trainer.lr)
    return trainer.trained()
