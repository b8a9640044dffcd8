"""The memory plan of a model, from its configs alone: weights per component, activation peaks
per image size and batch, and whether it all fits a GPU.

Nothing here allocates a tensor: parameter counts are arithmetic on the config values (checked
against the modules built on the meta device in the tests), and activation peaks follow the
lifetimes of the tensors in this package's forward passes (`transformer.py`, `vae_blocks.py`),
checked against the CPU allocator's own peak on a real-width slice.

Units: bytes. `e` is the activation element size (2 for bf16, 4 for fp32). Shapes: B batch,
N image tokens ((H/16) * (W/16)), L text tokens, S = L + N, D the DiT width.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .folder import WeightsError, read_config, safetensors_files
from .transformer_config import TransformerConfig
from .vae_config import VAEConfig

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GB = 10**9  # GPU memory is quoted in decimal GB (an "80 GB" card holds at least 80e9 bytes)
GiB = 2**30
# Outside torch's tensors: the CUDA context, cuBLAS/cuDNN handles and workspaces.
CUDA_RESERVE = int(1.5 * GiB)
# The caching allocator rounds blocks up and fragments under changing shapes.
FRAGMENTATION = 1.10
TEXT_ENCODER_PLACEMENTS = ("gpu", "cpu", "offload")
# Qwen-Image's prompt template: its 34 leading tokens are dropped, a few trail the prompt.
QWEN_TEMPLATE_TOKENS = 40


# -- parameters ---------------------------------------------------------------------------------


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


def _qwen_text(c: dict[str, Any]) -> dict[str, Any]:
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
        t = _qwen_text(config)
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


# -- activations --------------------------------------------------------------------------------


def dit_activation_bytes(
    cfg: TransformerConfig,
    batch: int,
    height: int,
    width: int,
    text_len: int,
    e: int,
    attention: str = "fused",
) -> int:
    """Peak bytes above the weights of one DiT forward of `batch` sequences.

    Per sequence, in units of D * e: a block's q, k, v and attention output (4 S) stay alive
    through its MLPs; the image MLP then also holds the block input, the attention projection,
    the first residual and its normed copy (4 N), the text stream (3 L) and the 4D-wide
    up-projection with its GELU (8 N); the text MLP the same with N and L swapped. The larger of
    the two is the peak (the attention itself needs less). "fused" is SDPA's flash or
    memory-efficient kernel; "math" materialises the scores and their softmax, 2 x heads x S^2
    elements (a masked attention where no fused kernel takes the mask).
    """
    N, L = (height // 16) * (width // 16), text_len
    S, D = N + L, cfg.inner_dim
    block = (4 * S + 12 * max(N, L) + 3 * min(N, L)) * D * e
    if attention == "math":
        block = max(block, 4 * S * D * e + 2 * cfg.num_attention_heads * S * S * e)
    elif attention != "fused":
        raise ValueError(f"attention must be 'fused' or 'math', got {attention!r}")
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
    attention = _norm_peak(c, e) + 3 * c * e + 2 * c * e  # norm, qkv, output and its re-laid copy
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
        t = _qwen_text(config)
        H, inter = t["hidden_size"], t["intermediate_size"]
    return tokens * e * (4 * H + 3 * inter)


# -- the model and its plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelMemory:
    """What sizes a model: its configs (text_encoder None when the folder has none)."""

    transformer: TransformerConfig
    vae: VAEConfig
    text_encoder: dict[str, Any] | None = None
    name: str = ""

    @classmethod
    def from_dir(cls, root: str | Path, name: str | None = None) -> ModelMemory:
        """Read `transformer/`, `vae/` (and `text_encoder/`) config.json; no weights."""
        root = Path(root)
        te_dir = root / "text_encoder"
        return cls.from_configs(
            read_config(root / "transformer"),
            read_config(root / "vae"),
            read_config(te_dir) if (te_dir / "config.json").is_file() else None,
            name=name or str(root),
            where=str(root),
        )

    @classmethod
    def from_configs(
        cls, transformer: dict, vae: dict, text_encoder: dict | None, name: str = "", where: str = ""
    ) -> ModelMemory:
        t_where, v_where = f"{where}/transformer/config.json", f"{where}/vae/config.json"
        te = dict(text_encoder) if text_encoder is not None else None
        model = cls(
            TransformerConfig.from_dict(transformer, where=t_where),
            VAEConfig.from_dict(vae, v_where),
            te,
            name,
        )
        if te is not None:
            try:
                text_encoder_params(te)
            except KeyError as e:
                raise ValueError(f"{where}/text_encoder/config.json: missing key {e}") from e
        return model

    def params(self) -> dict[str, int]:
        out = {"transformer": transformer_params(self.transformer), "vae": vae_params(self.vae)}
        if self.text_encoder is not None:
            out["text_encoder"] = text_encoder_params(self.text_encoder)
        return out


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on the GPU, phase by phase, for one image size, batch and text-encoder placement.

    Phases: "encode" (prompts through the text encoder), "denoise" (the DiT forward) and
    "decode" (the VAE). `peak` is the largest phase. With `offload`, the text encoder comes onto
    the GPU only to encode a shard's prompts; when it cannot sit next to the DiT, the DiT waits
    in host memory meanwhile (`dit_swapped`).
    """

    model: str
    dtype: str
    width: int
    height: int
    batch: int
    text_encoder: str
    cfg: str
    vae_batch: int
    text_len: int
    weights: dict[str, int]  # component -> bytes (in the plan's dtype)
    phases: dict[str, int]  # phase -> peak bytes on the GPU (reserve and fragmentation included)
    activations: dict[str, int]  # phase -> activation bytes (before fragmentation)
    extra: dict[str, int] = field(default_factory=dict)  # e.g. the modulation table
    capacity: int | None = None  # bytes of the GPU, None: unknown
    dit_swapped: bool = False
    host: int = 0  # bytes kept in host memory (a CPU text encoder, a swapped DiT)
    device: str = "cuda"

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        gb = lambda b: round(b / GB, 2)  # noqa: E731
        return {
            "model": self.model,
            "bucket": f"{self.width}x{self.height}",
            "batch": self.batch,
            "dtype": self.dtype,
            "text_encoder": self.text_encoder,
            "cfg": self.cfg,
            "vae_batch": self.vae_batch,
            "text_len": self.text_len,
            "weights_gb": {k: gb(v) for k, v in self.weights.items()},
            "activations_gb": {k: gb(v) for k, v in self.activations.items()},
            "extra_gb": {k: gb(v) for k, v in self.extra.items()},
            "phases_gb": {k: gb(v) for k, v in self.phases.items()},
            "peak_gb": gb(self.peak),
            "peak_phase": self.peak_phase,
            "capacity_gb": None if self.capacity is None else gb(self.capacity),
            "fits": self.fits,
            "dit_swapped": self.dit_swapped,
            "host_gb": gb(self.host),
            "device": self.device,
        }

    def describe(self) -> str:
        """One line: '1328x1328 x1 bf16, text encoder cpu: peak 43.1 GB (decode) of 48 GB: fits'."""
        gb = lambda b: f"{b / GB:.1f}"  # noqa: E731
        verdict = ""
        if self.capacity is not None:
            verdict = f" of {gb(self.capacity)} GB: " + ("fits" if self.fits else "DOES NOT FIT")
        swap = ", DiT waits in host memory while encoding" if self.dit_swapped else ""
        where = f"text encoder {self.text_encoder}" if self.device == "cuda" else "on the CPU"
        return (
            f"{self.width}x{self.height} x{self.batch} {self.dtype}, {where}: "
            f"peak {gb(self.peak)} GB ({self.peak_phase}){verdict}{swap}"
        )


def plan_memory(
    model: ModelMemory,
    *,
    height: int,
    width: int,
    batch: int,
    dtype: str = "bf16",
    text_encoder: str = "gpu",
    cfg: str = "serial",
    vae_batch: int | None = 1,
    text_len: int = 512,
    modulation_table_steps: tuple[int, ...] = (),
    gpu_memory_gb: float | None = None,
    attention: str = "fused",
    device: str = "cuda",
) -> MemoryPlan:
    """The memory plan of generating `batch` images of height x width.

    cfg: "serial" (two DiT passes per step), "batched" (one pass of 2 x batch) or "off".
    vae_batch: images per VAE decode call (1 when the decode is compiled), None: the batch.
    text_len: the padded prompt length the DiT sees (the prompt-length bucket).
    modulation_table_steps: step counts of the schedules kept in "table" modulation-cache mode.
    device: "cuda" adds the CUDA context's reserve; "cpu" (an actor without a GPU) does not.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if text_encoder not in TEXT_ENCODER_PLACEMENTS:
        raise ValueError(f"text_encoder must be one of {TEXT_ENCODER_PLACEMENTS}, got {text_encoder!r}")
    if cfg not in ("serial", "batched", "off"):
        raise ValueError(f"cfg must be serial, batched or off, got {cfg!r}")
    if batch < 1 or height % 16 or width % 16 or height < 16 or width < 16:
        raise ValueError(
            f"need batch >= 1 and sizes that are multiples of 16, got {batch} x {width}x{height}"
        )
    e = DTYPE_BYTES[dtype]
    params = model.params()
    weights = {k: v * e for k, v in params.items()}
    dit_w, vae_w, te_w = weights["transformer"], weights["vae"], weights.get("text_encoder", 0)
    dit_batch = 2 * batch if cfg == "batched" else batch
    acts = {
        "denoise": dit_activation_bytes(model.transformer, dit_batch, height, width, text_len, e, attention),
        "decode": vae_decode_activation_bytes(model.vae, min(vae_batch or batch, batch), height, width, e),
    }
    tokens = text_len + (
        QWEN_TEMPLATE_TOKENS if model.text_encoder and "vision_config" in model.text_encoder else 0
    )
    if model.text_encoder is not None:
        acts["encode"] = text_encode_activation_bytes(model.text_encoder, tokens, e)
    extra: dict[str, int] = {}
    if modulation_table_steps:
        D, layers = model.transformer.inner_dim, model.transformer.num_layers
        extra["modulation_table"] = sum(modulation_table_steps) * layers * 2 * 6 * D * e
    # Latents, velocities and embeddings of the batch while the VAE runs: small, but resident.
    carried = sum(extra.values())
    resident = dit_w + vae_w + carried + (CUDA_RESERVE if device == "cuda" else 0)
    te_resident = te_w if text_encoder == "gpu" else 0
    frag = lambda b: int(b * FRAGMENTATION)  # noqa: E731
    phases = {
        "denoise": resident + te_resident + frag(acts["denoise"]),
        "decode": resident + te_resident + frag(acts["decode"]),
    }
    capacity = None if gpu_memory_gb is None else int(gpu_memory_gb * GB)
    swapped = False
    host = te_w if text_encoder != "gpu" else 0
    if "encode" in acts and text_encoder != "cpu":
        encode = resident + te_w + frag(acts["encode"])
        if text_encoder == "offload" and capacity is not None and encode > capacity:
            encode -= dit_w  # the DiT waits in host memory while the shard's prompts are encoded
            swapped = True
            host = max(host, te_w + dit_w)
        phases["encode"] = encode
    return MemoryPlan(
        model=model.name,
        dtype=dtype,
        width=width,
        height=height,
        batch=batch,
        text_encoder=text_encoder,
        cfg=cfg,
        vae_batch=min(vae_batch or batch, batch),
        text_len=text_len,
        weights=weights,
        phases=phases,
        activations=acts,
        extra=extra,
        capacity=capacity,
        dit_swapped=swapped,
        host=host,
        device=device,
    )


def largest_batch(model: ModelMemory, gpu_memory_gb: float, limit: int = 1024, **kwargs: Any) -> int:
    """The largest batch (<= limit) whose plan fits `gpu_memory_gb`; 0 when not even 1 fits.
    kwargs: as for `plan_memory` (height and width required)."""
    fits = lambda b: bool(plan_memory(model, batch=b, gpu_memory_gb=gpu_memory_gb, **kwargs).fits)  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, limit  # peak grows with the batch: bisect for the last batch that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# -- checkpoints on disk --------------------------------------------------------------------------

_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


@dataclass(frozen=True)
class CheckpointSize:
    """What a component's safetensors headers say: tensors, parameters, bytes on disk, dtypes."""

    files: int
    tensors: int
    params: int
    bytes: int
    dtypes: tuple[str, ...]


def checkpoint_size(component_dir: str | Path) -> CheckpointSize:
    """Read only the safetensors headers (8-byte length + JSON) of one component folder."""
    files = safetensors_files(Path(component_dir))
    tensors = params = nbytes = 0
    dtypes: set[str] = set()
    for f in files:
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise WeightsError(
                    f"{f}: shorter than a safetensors header; the file is truncated. Re-download it."
                )
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20:
                raise WeightsError(f"{f}: header length {n} is not plausible; not a safetensors file.")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsError(f"{f}: unreadable safetensors header ({e}).") from e
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= int(d)
            tensors += 1
            params += count
            nbytes += count * _SAFETENSORS_BYTES.get(info["dtype"], 0)
            dtypes.add(info["dtype"])
    return CheckpointSize(len(files), tensors, params, nbytes, tuple(sorted(dtypes)))
