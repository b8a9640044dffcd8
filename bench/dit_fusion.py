"""Issue 50, lever 5 side by side: the DiT forward with the image's q/k/v as three GEMMs
(before) and as one fused GEMM (after, what the loader sets up), on the same weights; and the
hand-off from the attention kernel to the output projections as it was (both streams cloned out
of the attention output) against now (projections read views of it).

A few blocks at Qwen-Image's published widths (hidden 3072, text dim 3584) with random weights;
the two forwards run interleaved, round after round, so machine noise hits them alike.

    python bench/dit_fusion.py                                   # CPU: 2 blocks, 256x256, fp32
    python bench/dit_fusion.py --device cuda --dtype bf16 --size 1024 --layers 4

On CPU times are CPU time of this process (other tenants do not inflate it); on CUDA, wall time
with the device synchronised. One JSON line at the end. On the GPU the node self-test's `dit`
stage prints the same comparison (`projections`: `fused_speedup`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.dit_forward import Clock, published_config, twin  # noqa: E402
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, merge_heads  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--text", type=int, default=64, help="text tokens")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=24, help="24: Qwen-Image's; fewer keeps its proportions")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    cfg = published_config(args.layers, args.heads)
    before = QwenImageTransformer(cfg).to(device, dtype).eval().requires_grad_(False)
    after = twin(before, cfg)  # the same weight tensors ...
    after.fuse_qkv()  # ... but q/k/v read from one (3D, D) weight (a copy)
    h = w = args.size // 16
    B, L = args.batch, args.text
    x = torch.randn(B, h * w, cfg.in_channels, device=device, dtype=dtype)
    txt = torch.randn(B, L, cfg.joint_attention_dim, device=device, dtype=dtype)
    t = torch.full((1,), 0.5, device=device, dtype=dtype)
    shapes = [(1, h, w)] * B
    clock = Clock(device)

    def forward(model):
        return lambda: model(x, txt, None, t, shapes)

    times: dict[str, list[float]] = {"three_gemms": [], "fused": []}
    with torch.no_grad():
        same = torch.equal(forward(before)(), forward(after)())
        for _ in range(args.rounds):
            times["three_gemms"].append(clock.ms(forward(before)))
            times["fused"].append(clock.ms(forward(after)))
        handoff = _handoff(after, B, h * w, L, device, dtype, clock, args.rounds)
    ms = {k: round(statistics.median(v), 2) for k, v in times.items()}
    line = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "size": f"{args.size}x{args.size}",
        "layers": args.layers,
        "heads": cfg.num_attention_heads,
        "batch": B,
        "text_tokens": L,
        "ms_per_forward": ms,
        "fused_speedup": round(ms["three_gemms"] / ms["fused"], 3),
        "outputs_bit_identical": same,
        "attention_handoff_ms": handoff,
    }
    print(json.dumps(line))


def _handoff(model, B: int, N: int, L: int, device, dtype, clock: Clock, rounds: int) -> dict[str, float]:
    """ms of one block's attention output -> its two output projections: cloned streams (before)
    against views of the merged heads (now), the attention output in the fused kernels' layout."""
    attn = model.transformer_blocks[0].attn
    H, hd = attn.heads, attn.head_dim
    out = torch.randn(B, N + L, H, hd, device=device, dtype=dtype).transpose(1, 2)

    def cloned():
        joint = out.transpose(1, 2).reshape(B, N + L, H * hd)
        return attn.project_out(joint[:, :N].clone(), joint[:, N:].clone())

    def viewed():
        joint = merge_heads(out)
        return attn.project_out(joint[:, :N], joint[:, N:])

    times: dict[str, list[float]] = {"cloned": [], "views": []}
    for _ in range(rounds):
        times["cloned"].append(clock.ms(cloned))
        times["views"].append(clock.ms(viewed))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


if __name__ == "__main__":
    main()
