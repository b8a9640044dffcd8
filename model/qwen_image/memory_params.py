"""Parameter counts of the DiT, the VAE and the text encoders, from their configs alone.

Arithmetic on the config values, module by module as this package builds them (checked against
the modules built on the meta device in the tests).
"""

from __future__ import annotations

from typing import Any

from ditfleet.model.loading.quantization import check_quantization, fp8_keep, keeps_load_dtype
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.qwen_image.vae_config import VAEConfig
from ditfleet.model.settings import DEFAULT_PIPELINE, Fp8Layers, Quantization


def _linear(i: int, o: int, bias: bool = True) -> int:
    return i * o + (o if bias else 0)


def transformer_params(cfg: TransformerConfig) -> int:
    """Parameters of `QwenImageTransformer(cfg)`."""
    D, hd = cfg.inner_dim, cfg.attention_head_dim
    block = (
        2 * _linear(D, 6 * D)  # img_mod.1, txt_mod.1
        + 8 * _linear(D, D)  # to_q/k/v, add_q/k/v_proj, to_out.0, to_add_out
        + 4 * hd  # q/k norms of both streams
        + 2 * (_linear(D, 4 * D) + _linear(4 * D, D))  # img_mlp, txt_mlp
    )
    out = cfg.patch_size**2 * (cfg.out_channels or cfg.in_channels)
    rest = (
        _linear(256, D) + _linear(D, D)  # timestep embedder
        + (2 * D if cfg.use_additional_t_cond else 0)
        + cfg.joint_attention_dim  # txt_norm
        + _linear(cfg.in_channels, D) + _linear(cfg.joint_attention_dim, D)  # img_in, txt_in
        + _linear(D, 2 * D) + _linear(D, out)  # norm_out.linear, proj_out
    )  # fmt: skip
    return cfg.num_layers * block + rest


def transformer_linears(cfg: TransformerConfig) -> list[tuple[str, int, int]]:
    """(module name, in_features, out_features) of every nn.Linear of `QwenImageTransformer(cfg)`,
    by diffusers' names (all with a bias)."""
    D = cfg.inner_dim
    out = cfg.patch_size**2 * (cfg.out_channels or cfg.in_channels)
    rows = [
        ("time_text_embed.timestep_embedder.linear_1", 256, D),
        ("time_text_embed.timestep_embedder.linear_2", D, D),
        ("img_in", cfg.in_channels, D),
        ("txt_in", cfg.joint_attention_dim, D),
        ("norm_out.linear", D, 2 * D),
        ("proj_out", D, out),
    ]
    per_block = [("img_mod.1", D, 6 * D), ("txt_mod.1", D, 6 * D)]
    per_block += [
        (f"attn.{n}", D, D) for n in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
    ]
    per_block += [("attn.to_out.0", D, D), ("attn.to_add_out", D, D)]
    for mlp in ("img_mlp", "txt_mlp"):
        per_block += [(f"{mlp}.net.0.proj", D, 4 * D), (f"{mlp}.net.2", 4 * D, D)]
    for i in range(cfg.num_layers):
        rows += [(f"transformer_blocks.{i}.{n}", a, b) for n, a, b in per_block]
    return rows


def transformer_weight_bytes(
    cfg: TransformerConfig,
    e: int,
    quantization: Quantization = "none",
    fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers,
) -> int:
    """Bytes of the DiT's weights as loaded: every parameter in `e`-byte elements, or under an
    FP8 quantization (model.qwen_image.fp8) each quantized Linear's weight in 1 byte plus one fp32 scale per
    output channel (its bias, every layer the set `fp8_layers` keeps, norms and embeddings still
    `e` bytes)."""
    total = transformer_params(cfg) * e
    if check_quantization(quantization) == "none":
        return total
    keep = fp8_keep(fp8_layers)
    for name, i, o in transformer_linears(cfg):
        if not keeps_load_dtype(name, keep):
            total -= i * o * e - (i * o + 4 * o)
    return total


def _conv(i: int, o: int, k: int) -> int:
    return i * o * k * k + o


def _resblock(i: int, o: int) -> int:
    return i + _conv(i, o, 3) + o + _conv(o, o, 3) + (_conv(i, o, 1) if i != o else 0)


def _attnblock(c: int) -> int:
    return c + _conv(c, 3 * c, 1) + _conv(c, c, 1)


def _mid(c: int) -> int:
    return 2 * _resblock(c, c) + _attnblock(c)


def vae_params(cfg: VAEConfig, with_encoder: bool = False) -> int:
    """Parameters of the 2D `QwenImageVAE(cfg, with_encoder)` (the decoder alone by default, as
    the pipeline loads it)."""
    base, mult, nres = cfg.base_dim, cfg.dim_mult, cfg.num_res_blocks
    dims = [base * u for u in (mult[-1], *mult[::-1])]
    n = _conv(cfg.z_dim, cfg.z_dim, 1) + _conv(cfg.z_dim, dims[0], 3) + _mid(dims[0])
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        d_in = d_in // 2 if i > 0 else d_in
        for j in range(nres + 1):
            n += _resblock(d_in if j == 0 else d_out, d_out)
        if i != len(mult) - 1:
            n += _conv(d_out, d_out // 2, 3)  # upsampler conv
    n += dims[-1] + _conv(dims[-1], cfg.input_channels, 3)  # norm_out, conv_out
    if with_encoder:
        n += _vae_encoder_params(cfg)
    return n


def _vae_encoder_params(cfg: VAEConfig) -> int:
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    n = _conv(cfg.input_channels, dims[0], 3)
    scale = 1.0
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(cfg.num_res_blocks):
            n += _resblock(d_in, d_out)
            if scale in cfg.attn_scales:
                n += _attnblock(d_out)
            d_in = d_out
        if i != len(cfg.dim_mult) - 1:
            n += _conv(d_out, d_out, 3)
            scale /= 2.0
    n += _mid(dims[-1]) + dims[-1] + _conv(dims[-1], 2 * cfg.z_dim, 3)
    return n + _conv(2 * cfg.z_dim, 2 * cfg.z_dim, 1)  # quant_conv


def qwen_text_config(c: dict[str, Any]) -> dict[str, Any]:
    """The language-model keys of a Qwen2.5-VL config, flat (older files) or under text_config."""
    text = dict(c.get("text_config") or {})
    return {**{k: v for k, v in c.items() if k not in ("text_config", "vision_config")}, **text}


def text_encoder_params(config: dict[str, Any], where: str = "text_encoder/config.json") -> int:
    """Parameters of the text encoder a `text_encoder/config.json` describes, as it is loaded
    (Qwen2.5-VL: language model, vision tower and lm_head; the tiny encoder: all of it)."""
    cls = config.get("_class_name") or (config.get("architectures") or [""])[0]
    if cls == "TinyTextEncoder":
        H, V, P = config["hidden_size"], config["vocab_size"], config["max_positions"]
        block = 2 * 2 * H + _linear(H, 3 * H) + _linear(H, H) + _linear(H, 4 * H) + _linear(4 * H, H)
        return V * H + P * H + config["num_layers"] * block + 2 * H
    if cls.startswith("Qwen2_5_VL"):
        t = qwen_text_config(config)
        H, inter, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
        kv = t["num_key_value_heads"] * (H // t["num_attention_heads"])
        layer = _linear(H, H) + 2 * _linear(H, kv) + _linear(H, H, bias=False) + 3 * H * inter + 2 * H
        lm_head = 0 if t.get("tie_word_embeddings", False) else V * H
        return (
            V * H
            + t["num_hidden_layers"] * layer
            + H
            + lm_head
            + _qwen_vision_params(config["vision_config"])
        )
    raise ValueError(f"{where}: unknown text encoder class {cls!r}; cannot size it")


def _qwen_vision_params(v: dict[str, Any]) -> int:
    h, i = v["hidden_size"], v["intermediate_size"]
    merged = h * v.get("spatial_merge_size", 2) ** 2
    patch = (
        v.get("in_channels", v.get("in_chans", 3))
        * v.get("temporal_patch_size", 2)
        * v["patch_size"] ** 2
        * h
    )
    block = 2 * h + _linear(h, 3 * h) + _linear(h, h) + 2 * _linear(h, i) + _linear(i, h)
    merger = h + _linear(merged, merged) + _linear(merged, v["out_hidden_size"])
    return patch + v["depth"] * block + merger
