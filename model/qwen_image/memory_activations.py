"""Activation peaks: bytes above the weights of one DiT forward, one VAE decode, one VAE encode (an
edit model's sources), one prompt encode, one vqa score.

They follow the lifetimes of the tensors in this package's forward passes (`transformer.py`,
`vae_blocks.py`), checked against the CPU allocator's own peak on a real-width slice.
Units: bytes; `e` is the activation element size (2 for bf16, 4 for fp32).
"""

from __future__ import annotations

from typing import Any

from ditfleet.model.qwen_image.qwen_vision_size import smart_resize
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.qwen_image.vae_config import VAEConfig

from .memory_params import qwen_text_config

# The question around the prompt and the image (model.quality.vqa: system turn, question, turn
# markers, vision start and end): 34 tokens with Qwen's tokenizer, about one a word, rounded up.
VQA_TEMPLATE_TOKENS = 48
# Pixels per image token side: the VAE's 8x downsampling times the DiT's 2x2 patches.
PIXELS_PER_TOKEN_SIDE = 16


def image_tokens(height: int, width: int) -> int:
    """The DiT's image-stream sequence length N for an image of height x width pixels."""
    return (height // PIXELS_PER_TOKEN_SIDE) * (width // PIXELS_PER_TOKEN_SIDE)


def dit_activation_bytes(
    cfg: TransformerConfig,
    batch: int,
    height: int,
    width: int,
    text_len: int,
    e: int,
    attention: str = "fused",
    device: str = "cpu",
    source_tokens: int = 0,
) -> int:
    """Peak bytes above the weights of one DiT forward of `batch` sequences.

    source_tokens: an edit model's source latents per sequence, image tokens after the target's
    (model.qwen_image.edit): the image stream is N + source_tokens long.

    Per sequence, in units of D * e: a block's q, k, v and attention output (4 S) stay alive
    through its MLPs; the image MLP then also holds the block input, the attention projection,
    the first residual and its normed copy (4 N), the text stream (3 L) and the 4D-wide
    up-projection with its GELU (8 N); the text MLP the same with N and L swapped. The larger of
    the two is the peak (the attention itself needs less). "fused" is SDPA's flash or
    memory-efficient kernel; "math" materialises the scores and their softmax, 2 x heads x S^2
    elements (a masked attention where no fused kernel takes the mask).

    On CUDA the forward holds more than these lifetimes: measured on an H200 (bf16, 60 blocks,
    text 128, the node self-test's dit_eager lines), 0.786 GB above the weights at 1328x1328 and
    0.469 GB at 1024x1024, about 2.3 S more than the CPU allocator's peak that the terms above
    match, in proportion to S at both sizes. The cuDNN/flash kernels take q, k and v re-laid in
    their own layout, and those copies live beside the originals: counted as 3 S, which keeps the
    plan 3.7-4% above both measurements.
    """
    N, L = image_tokens(height, width) + source_tokens, text_len
    S, D = N + L, cfg.inner_dim
    block = (4 * S + 12 * max(N, L) + 3 * min(N, L)) * D * e
    if attention == "math":
        block = max(block, 4 * S * D * e + 2 * cfg.num_attention_heads * S * S * e)
    elif attention != "fused":
        raise ValueError(f"attention must be 'fused' or 'math', got {attention!r}")
    if device == "cuda":
        block += 3 * S * D * e
    inputs = (N * cfg.in_channels + L * cfg.joint_attention_dim) * e  # latents and prompt embeddings
    return batch * (block + inputs)


def _norm_peak(c: int, e: int) -> int:
    """Channel RMSNorm (vae_blocks.RMSNorm) of c channels, per pixel: half precision normalises
    an fp32 copy (2 fp32 tensors live), fp32 holds 3 tensors at `* scale * gamma`."""
    return max(2 * c * 4, 3 * c * e) if e < 4 else 3 * c * e


def _resblock_peak(i: int, o: int, e: int) -> int:
    """Per pixel, above the block's input (held by the caller). A 3x3 conv counts a copy of its
    input as workspace (the CPU's oneDNN reorders it; cuDNN's workspace is of that order)."""
    h = o * e if i != o else 0
    return h + max(
        _norm_peak(i, e),
        2 * i * e,  # norm1 output + SiLU
        2 * i * e + o * e,  # SiLU, its workspace copy, conv1
        o * e + _norm_peak(o, e),
        3 * o * e,  # conv1 output + norm2 output + SiLU
        4 * o * e,  # conv1 output, SiLU, its workspace copy, conv2
    )


def vae_decode_activation_bytes(cfg: VAEConfig, batch: int, height: int, width: int, e: int) -> int:
    """Peak bytes above the weights of decoding `batch` images of height x width.

    Walks the decoder's modules at their resolutions. A block's caller keeps the block's input
    alive while the block runs (`x = block(x)`), so inside an up block every resnet after the
    first also has the up block's input next to it. The peak is at full resolution: in the
    last upsampler (nearest 2x, then a conv) or in the last block's norms.
    """
    s = cfg.spatial_compression
    dims = [cfg.base_dim * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    px = (height // s) * (width // s)  # latent pixels
    c = dims[0]
    # norm, qkv, output and its re-laid copy; and the moment the conv's qkv and its dense copy
    # (the layout the fused kernel takes, vae_blocks.AttentionBlock) are both alive. The fused
    # kernel itself adds only a per-row log-sum-exp: no (HW, HW) scores.
    attention = max(_norm_peak(c, e) + 3 * c * e + 2 * c * e, 6 * c * e + 2 * c * e)
    peak = px * (2 * c * e + max(_resblock_peak(c, c, e), attention))  # conv_in output held by the caller
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        d_in = d_in // 2 if i > 0 else d_in
        for j in range(cfg.num_res_blocks + 1):
            cin = d_in if j == 0 else d_out
            held = 0 if j == 0 else d_in * e  # the up block's input
            peak = max(peak, px * (held + cin * e + _resblock_peak(cin, d_out, e)))
        if i != len(cfg.dim_mult) - 1:
            # block input and last resnet output, then the upsampled map, its copy, the conv output
            peak = max(peak, px * (d_in + d_out) * e + 4 * px * (2 * d_out * e + d_out // 2 * e))
            px *= 4
    last = dims[-1]
    peak = max(peak, px * (last * e + max(_norm_peak(last, e), 2 * last * e)))  # norm_out, SiLU
    return batch * peak


def vae_encode_activation_bytes(cfg: VAEConfig, batch: int, height: int, width: int, e: int) -> int:
    """Peak bytes above the weights of encoding `batch` source images of height x width (an edit
    model's sources, at their VAE size): the encoder's modules walked at their resolutions as
    `vae_decode_activation_bytes` walks the decoder's, a block's input held by its caller. The
    peak is at full resolution, in the first level's resnets; the strided downsamplers hold their
    input, its padded copy and their output. Within 0.4% of the CPU allocator's peak at the
    published widths, fp32 and bf16 (tests/unit/driver/test_memory_plan.py)."""
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    px = height * width
    peak = px * (cfg.input_channels + dims[0]) * e  # the image and conv_in's output
    for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
        cin = d_in
        for _ in range(cfg.num_res_blocks):
            peak = max(peak, px * (cin * e + _resblock_peak(cin, d_out, e)))
            cin = d_out
        if i != len(cfg.dim_mult) - 1:
            peak = max(peak, px * 2 * d_out * e + px // 4 * d_out * e)
            px //= 4
    c = dims[-1]
    attention = max(_norm_peak(c, e) + 5 * c * e, 8 * c * e)  # the mid block's, as in the decoder
    peak = max(peak, px * (c * e + max(_resblock_peak(c, c, e), attention)))
    return batch * peak


def text_encode_activation_bytes(config: dict[str, Any], tokens: int, e: int) -> int:
    """Peak bytes above the weights of encoding one prompt of `tokens` tokens (prompts are
    encoded one at a time, without the LM head: the final norm's output is captured): the
    residual stream, its norm, attention output and the captured state (4 H), and the MLP's gate,
    up and product (3 x the intermediate width)."""
    cls = config.get("_class_name") or (config.get("architectures") or [""])[0]
    if cls == "TinyTextEncoder":
        H, inter = config["hidden_size"], 4 * config["hidden_size"]
        tokens = min(tokens, config["max_positions"])
    else:
        t = qwen_text_config(config)
        H, inter = t["hidden_size"], t["intermediate_size"]
    return tokens * e * (4 * H + 3 * inter)


def vqa_activation_bytes(config: dict[str, Any], height: int, width: int, text_len: int, e: int) -> int:
    """Peak bytes above the weights of scoring one height x width image with vqa
    (model.quality.vqa): one forward of the Qwen2.5-VL text encoder, the image alone.

    P patches (the image resized as Qwen2.5-VL's preprocessing does, model.qwen_image.qwen_vision_size) go
    through the vision tower, then T = P / merge^2 image tokens, the prompt (counted at the DiT's
    text length `text_len`; vqa asks a longer one whole) and the question through the language
    model. Held throughout: the patches, in fp32 and in the weights' dtype, and the question's
    token embeddings (T x H). The tower's peak is in a block's attention: its input, norm and qkv
    (5 h) in the weights' dtype while transformers' vision RoPE works in fp32 (q and k upcast,
    their rotate_half and products: 6 h fp32), beside the RoPE tables (2 x head_dim fp32); the
    MLP (2 h + 3 x the intermediate width) is smaller. The language model's is the prompt
    encode's (`text_encode_activation_bytes`) over T tokens, with the tower's last state (P x h)
    and the image embeddings (T_image x H) still held. Then one position's logits over the
    vocabulary, an fp32 copy and its log-softmax. Measured on the CPU allocator at the published
    widths (tests/unit/driver/test_vqa_memory.py).
    """
    v, t = config["vision_config"], qwen_text_config(config)
    patch, merge = v["patch_size"], v.get("spatial_merge_size", 2)
    h_px, w_px = smart_resize(height, width, patch * merge)
    P = (h_px // patch) * (w_px // patch)  # vision patches
    image_tokens_ = P // merge**2
    T = image_tokens_ + text_len + VQA_TEMPLATE_TOKENS
    h, H = v["hidden_size"], t["hidden_size"]
    pixels = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * patch**2  # per patch
    held = P * pixels * (4 + (e if e != 4 else 0)) + T * H * e
    rope = 2 * (h // v["num_heads"]) * 4
    block = max(5 * h * e + 6 * h * 4, (2 * h + 3 * v["intermediate_size"]) * e)
    vision = P * (block + rope)
    language = text_encode_activation_bytes(config, T, e) + P * h * e + image_tokens_ * H * e
    logits = t["vocab_size"] * (e + 2 * 4)
    return held + max(vision, language) + logits
