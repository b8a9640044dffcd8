"""The DiT at the published Qwen-Image widths: ours eager, ours compiled, diffusers eager.

On CPU in fp32 the compiled DiT runs its linears through oneDNN (compile.cpu_linear); the same
compiled DiT with aten's linears ("ours_compiled_aten_linear") runs alongside, so the gain of
that choice is measured in the same run.

A few blocks of the real shape (hidden 3072 = 24 heads x 128, text dim 3584, RoPE axes
(16, 56, 56)) with random weights; diffusers' QwenImageTransformer2DModel runs on the very same
weight tensors. They run interleaved, round after round, so machine noise hits them alike.
Per image size it reports: ms per forward (batch 1, no padding: diffusers gets no mask either),
ms per CFG step (conditional + one-token negative) with the modulation cache off / cfg / table,
the share of the forward spent in attention, and the padded-attention kernels side by side
(dense mask vs unmasked vs split by text length, batch 2 with one shorter prompt).

    python bench/dit_forward.py                        # CPU: 2 blocks at 256x256 and 512x512, fp32
    python bench/dit_forward.py --device cuda --size 1328 --layers 60   # + percent of bf16 peak

On CPU times are CPU time of this process (other tenants do not inflate it); on CUDA, wall time
with the device synchronised. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ditfleet.model.qwen_image.transformer as transformer_module
from ditfleet.compile import CompileConfig
from ditfleet.compile.compiled_method import compiled_method
from ditfleet.compile.policy import dit_linears
from ditfleet.model.generation.sampling import latent_grid
from ditfleet.model.qwen_image.attention import TextPadding, joint_attention
from ditfleet.model.qwen_image.family import QWEN_IMAGE, forward_flops
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig

# Dense bf16 tensor-core peak, TFLOP/s, by device name (vendor data sheets, SXM parts).
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def published_config(layers: int, heads: int = 24) -> TransformerConfig:
    """Qwen-Image's block at 24 heads; fewer heads keep its proportions (text dim 3584/3072 of
    the hidden size) for a smoke run."""
    return TransformerConfig(
        num_layers=layers,
        num_attention_heads=heads,
        attention_head_dim=128,
        joint_attention_dim=3584 * heads // 24,
        axes_dims_rope=(16, 56, 56),
    )


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def ms(self, fn: Callable[[], object]) -> float:
        start = self.now()
        fn()
        return (self.now() - start) * 1000


def diffusers_twin(ours: QwenImageTransformer, device: torch.device, dtype: torch.dtype):
    """diffusers' transformer over the same weight tensors (no copy)."""
    from diffusers import QwenImageTransformer2DModel

    d = ours.config.to_dict()
    kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**kwargs)
    ref.load_state_dict(ours.state_dict(), assign=True, strict=True)
    # Its RoPE tables are plain attributes computed at construction: rebuild them for real.
    ref.pos_embed = type(ref.pos_embed)(
        theta=10000, axes_dim=list(ours.config.axes_dims_rope), scale_rope=True
    )
    return ref.to(device).eval().requires_grad_(False)


def compile_blocks(
    model: QwenImageTransformer, device_type: str, mode: str | None, backend: str, onednn: bool = True
) -> None:
    """What apply_compile does to a pipeline's transformer: compiled block functions, and on CPU
    (unless `onednn` is off) fp32 linears through oneDNN."""
    config = CompileConfig(dit=True, dit_mode=mode, dit_backend=backend, cpu_onednn_linear=onednn)
    dit_linears(model, config, device_type)
    for region in QWEN_IMAGE.compile_regions:
        if region.part == "dit":
            for _prefix, block in region.owners(model):
                for name, dims in region.methods.items():
                    compiled_method(
                        block, name, config.compile_kwargs("dit", device_type), dynamic_dims=dict(dims)
                    )


def twin(ours: QwenImageTransformer, cfg: TransformerConfig) -> QwenImageTransformer:
    """Another transformer over the same weight tensors (no copy)."""
    with torch.device("meta"):
        model = QwenImageTransformer(cfg)
    model.load_state_dict(ours.state_dict(), assign=True)
    return model.eval().requires_grad_(False)


def attention_ms(ours: QwenImageTransformer, run: Callable[[], object], clock: Clock) -> tuple[float, float]:
    """(total ms, ms inside the attention kernel) of one eager forward."""
    spent = [0.0]
    original = transformer_module.joint_attention

    def timed(*args, **kwargs):
        start = clock.now()
        out = original(*args, **kwargs)
        spent[0] += (clock.now() - start) * 1000
        return out

    transformer_module.joint_attention = timed
    try:
        total = clock.ms(run)
    finally:
        transformer_module.joint_attention = original
    return total, spent[0]


def padded_kernels(
    cfg: TransformerConfig, img_tokens: int, text: int, device, dtype, clock: Clock, rounds: int
):
    """ms of the attention call alone for a batch of 2 prompts of `text` and `text // 2` tokens."""
    H, hd, B = cfg.num_attention_heads, cfg.attention_head_dim, 2
    S = img_tokens + text
    q, k, v = (torch.randn(B, S, H, hd, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    mask = torch.ones(B, text, dtype=torch.long, device=device)
    mask[1, text // 2 :] = 0
    dense = TextPadding.build(mask, B, text, img_tokens, mode="mask")
    split = TextPadding.build(mask, B, text, img_tokens, mode="split")
    kernels = {
        "dense_mask": lambda: joint_attention(q, k, v, dense),
        "unmasked": lambda: F.scaled_dot_product_attention(q, k, v),
        "split": lambda: joint_attention(q, k, v, split),
    }
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()
    for _ in range(rounds):
        for name, fn in kernels.items():
            times[name].append(clock.ms(fn))
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def _unfused_rms_rotary(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RMS norm cast to the weight dtype, then RoPE by stack of real halves: the reference form."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(var + 1e-6)).to(weight.dtype) * weight
    xf = normed.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def elementwise(cfg: TransformerConfig, tokens: int, device, dtype, clock: Clock, rounds: int) -> dict:
    """ms of each elementwise group of a block on `tokens` tokens: the reference's separate ops
    ("unfused") against ours (model.qwen_image.transformer's helpers), eager."""
    from ditfleet.model.qwen_image.rope import Rotation
    from ditfleet.model.qwen_image.transformer import RMSNorm, _gated_residual, _norm_modulate, _rms_rotary

    D, H, hd = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, H, hd, generator=g).to(device, dtype)
    h, y = (torch.randn(1, tokens, D, generator=g).to(device, dtype) for _ in range(2))
    shift, scale, gate = (torch.randn(1, D, generator=g).to(device, dtype) for _ in range(3))
    norm = RMSNorm(hd).to(device, dtype)
    rot = Rotation.from_angles(torch.randn(tokens, hd // 2, generator=g)).to(device)
    pairs = {
        "rms_norm_rope": (
            lambda: _unfused_rms_rotary(x, norm.weight, rot.cos, rot.sin),
            lambda: _rms_rotary(x, norm, rot),
        ),
        "layer_norm_modulate": (
            lambda: F.layer_norm(h, (D,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None],
            lambda: _norm_modulate(h, shift, scale, 1e-6),
        ),
        "gate_residual": (lambda: h + gate[:, None] * y, lambda: _gated_residual(h, gate, y)),
    }
    out = {}
    for name, (ref_fn, ours_fn) in pairs.items():
        times: dict[str, list[float]] = {"unfused": [], "ours": []}
        ref_fn(), ours_fn()
        for _ in range(max(rounds, 5)):
            times["unfused"].append(clock.ms(ref_fn))
            times["ours"].append(clock.ms(ours_fn))
        out[name] = {k: round(statistics.median(v), 2) for k, v in times.items()}
    return out


def bench_size(size, args, cfg, ours, compiled, compiled_aten, ref, device, dtype, clock, peak) -> dict:
    """One image size: every number of the report."""
    h, w = latent_grid(size, size)
    N, L = h * w, args.text_tokens
    g = torch.Generator().manual_seed(size)
    x = torch.randn(1, N, 64, generator=g).to(device, dtype)
    txt = torch.randn(1, L, cfg.joint_attention_dim, generator=g).to(device, dtype)
    neg = torch.randn(1, 1, cfg.joint_attention_dim, generator=g).to(device, dtype)
    shapes = [[(1, h, w)]]
    runs: dict[str, Callable[[], object]] = {}
    with torch.no_grad():
        t = torch.full((1,), 0.5, device=device, dtype=dtype)
        runs["ours_eager"] = lambda: ours(x, txt, None, t, shapes)
        if compiled is not None:
            runs["ours_compiled"] = lambda: compiled(x, txt, None, t, shapes)
        if compiled_aten is not None:
            runs["ours_compiled_aten_linear"] = lambda: compiled_aten(x, txt, None, t, shapes)
        if ref is not None:
            runs["diffusers_eager"] = lambda: ref(
                hidden_states=x, encoder_hidden_states=txt, encoder_hidden_states_mask=None,
                timestep=t, img_shapes=shapes, return_dict=False,
            )  # fmt: skip
        warm_start = time.perf_counter()
        for fn in runs.values():
            fn()  # the compiled one compiles here
        warm_s = time.perf_counter() - warm_start
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(clock.ms(fn))
        ms = {name: round(statistics.median(v), 1) for name, v in times.items()}

        # One CFG step (cond + one-token negative, same timestep tensor) per cache mode.
        steady = compiled if compiled is not None else ours
        cfg_ms: dict[str, list[float]] = {"off": [], "cfg": [], "table": []}
        step_t = torch.full((1,), 0.25, device=device, dtype=dtype)
        for _ in range(args.rounds):
            for mode in cfg_ms:
                if steady.modulation_cache.mode != mode:
                    steady.modulation_cache.set_mode(mode)
                if mode == "table":
                    steady(x, txt, None, step_t, shapes)  # fill the table for this step
                cfg_ms[mode].append(
                    clock.ms(
                        lambda: (steady(x, txt, None, step_t, shapes), steady(x, neg, None, step_t, shapes))
                    )
                )
        steady.modulation_cache.set_mode("cfg")
        total, in_attention = attention_ms(ours, runs["ours_eager"], clock)
        kernels = padded_kernels(cfg, N, L, device, dtype, clock, args.rounds)

    flops = forward_flops(cfg, N, L)["total"]
    row = {
        "image_tokens": N,
        "text_tokens": L,
        "ms_per_forward": ms,
        "ms_per_cfg_step": {m: round(statistics.median(v), 1) for m, v in cfg_ms.items()},
        "cfg_step_model": "ours_compiled" if compiled is not None else "ours_eager",
        "attention_share_eager": round(in_attention / total, 3),
        "padded_attention_ms": kernels,
        "first_calls_s": round(warm_s, 1),
        "forward_tflop": round(flops / 1e12, 3),
    }
    base = ms.get("diffusers_eager")
    for name in ("ours_eager", "ours_compiled", "ours_compiled_aten_linear"):
        if base and name in ms:
            row[f"speedup_{name}_vs_diffusers"] = round(base / ms[name], 3)
    if peak and device.type == "cuda":
        row["percent_of_bf16_peak"] = {
            name: round(100 * flops / (v / 1000) / (peak * 1e12), 1) for name, v in ms.items()
        }
    print(f"{size}x{size} ({N} image + {L} text tokens, {args.layers} blocks): {row}", flush=True)
    return row


def build_models(args, cfg: TransformerConfig, device: torch.device, dtype: torch.dtype):
    """(ours eager, ours compiled or None, ours compiled with aten's linears or None, diffusers
    or None), every one over the same weight tensors."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = QwenImageTransformer(cfg)
    ours = ours.to(dtype).eval().requires_grad_(False)
    ref = None if args.no_diffusers else diffusers_twin(ours, device, dtype)
    compiled, compiled_aten = None, None
    if not args.no_compile:
        compiled = twin(ours, cfg)
        compile_blocks(compiled, device.type, args.compile_mode, args.compile_backend)
        if device.type == "cpu" and dtype == torch.float32 and not args.no_aten_linear:
            # The same compiled DiT with aten's linears: what oneDNN's linears gain, in this run.
            compiled_aten = twin(ours, cfg)
            compile_blocks(compiled_aten, device.type, args.compile_mode, args.compile_backend, onednn=False)
    return ours, compiled, compiled_aten, ref


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda, fp32 else"
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=24, help="24: the published widths; fewer: a smoke run")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--size", type=int, action="append", help="image side in pixels; repeatable")
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument(
        "--no-aten-linear",
        action="store_true",
        help="CPU fp32: skip the compiled DiT with aten's linears (the before of oneDNN's linears)",
    )
    ap.add_argument("--compile-mode", default=None, help="Inductor mode (default: the worker's choice)")
    ap.add_argument("--elementwise-only", action="store_true", help="only the elementwise groups")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak (default: by GPU name)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    sizes = args.size or [256, 512]
    clock = Clock(device)
    cfg = published_config(args.layers, args.heads)
    if args.elementwise_only:
        for size in sizes:
            h, w = latent_grid(size, size)
            tokens = h * w + args.text_tokens
            row = elementwise(cfg, tokens, device, dtype, clock, args.rounds)
            print(json.dumps({"bench": "dit_forward_elementwise", "size": size, "tokens": tokens,
                              "dtype": str(dtype).removeprefix("torch."), "ms": row}))  # fmt: skip
        return
    ours, compiled, compiled_aten, ref = build_models(args, cfg, device, dtype)

    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)

    results = {
        f"{size}x{size}": bench_size(
            size, args, cfg, ours, compiled, compiled_aten, ref, device, dtype, clock, peak
        )
        for size in sizes
    }

    print(
        json.dumps(
            {
                "bench": "dit_forward",
                "device": str(device),
                "dtype": str(dtype).removeprefix("torch."),
                "layers": args.layers,
                "widths": {
                    "hidden": cfg.inner_dim,
                    "heads": cfg.num_attention_heads,
                    "text_dim": cfg.joint_attention_dim,
                },
                "bf16_peak_tflops": peak,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
