"""A DiT at Qwen-Image's published widths with random weights that have the outliers real ones do.

Uniform random weights quantize unrealistically well: every row has the same range. Trained
transformers have (a) a few residual-stream channels tens of times larger than the rest (the
"massive activations" of LLMs and DiTs alike), which per-token activation scales must span, and
(b) heavy-tailed weights, so one large entry sets a row's FP8 scale and the rest lose precision.
Both are built in here, deterministically from a seed:

- weights are Gaussian at nn.Linear's scale, with 1% of each matrix's input columns 6x larger;
- the embedders (img_in, txt_in) write `OUTLIER_CHANNELS` residual channels 25x larger, so every
  LayerNorm-ed block input carries those channel outliers into the attention and MLP GEMMs.

Used by bench/fp8.py and the FP8 tests; nothing here is used by a job.
"""

from __future__ import annotations

import torch

from ditfleet.model.qwen_image.published import published_config

OUTLIER_CHANNELS = (7, 301, 1500, 2900)  # of the 3072 residual channels
CHANNEL_GAIN = 25.0
HEAVY_COLUMNS = 0.01
COLUMN_GAIN = 6.0


def _outlier_weight(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    out_f, in_f = shape
    w = torch.randn(shape, generator=g) * (in_f**-0.5)
    cols = torch.randperm(in_f, generator=g)[: max(1, int(in_f * HEAVY_COLUMNS))]
    w[:, cols] *= COLUMN_GAIN
    return w


@torch.no_grad()
def outlier_transformer(num_layers: int = 1, seed: int = 0, model: str = "qwen-image"):
    """QwenImageTransformer at the published widths, `num_layers` deep, fp32 on the CPU."""
    from ditfleet.model.loading.weights import on_meta
    from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

    config = TransformerConfig.from_dict(
        {**published_config(model, "transformer/config.json"), "num_layers": num_layers}
    )
    with on_meta():
        dit = QwenImageTransformer(config)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in dit.state_dict().items():
        if t.dim() == 2:
            state[name] = _outlier_weight(tuple(t.shape), g)
        elif name.endswith(".weight"):  # norm scales
            state[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:  # biases
            state[name] = 0.02 * torch.randn(t.shape, generator=g)
    for emb in ("img_in", "txt_in"):
        state[f"{emb}.weight"][list(OUTLIER_CHANNELS)] *= CHANNEL_GAIN
        state[f"{emb}.bias"][list(OUTLIER_CHANNELS)] *= CHANNEL_GAIN
    dit.load_state_dict(state, assign=True, strict=True)
    return dit.eval().requires_grad_(False)


def forward_inputs(
    dit, grid: tuple[int, int] = (8, 8), text_len: int = 32, batch: int = 1, seed: int = 0
) -> dict:
    """Keyword arguments of one DiT forward: unit-variance latents and prompt features, t = 0.625
    (exact in bf16, so that every dtype sees the same timestep)."""
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    cfg = dit.config
    return {
        "hidden_states": torch.randn(batch, h * w, cfg.in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g),
        "encoder_hidden_states_mask": torch.ones(batch, text_len, dtype=torch.long),
        "timestep": torch.full((1,), 0.625),
        "img_shapes": [[(1, h, w)]] * batch,
    }


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||, in fp64."""
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm())


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
