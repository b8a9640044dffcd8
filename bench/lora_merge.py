"""What a LoRA adds to model load: reading the adapter file, matching it to the DiT, merging it.

    python bench/lora_merge.py [--layers 1] [--rank 64] [--dtype bf16] [--device cpu]

Builds the published Qwen-Image transformer config (model/qwen_image/published/qwen-image) with
`--layers` blocks (weights zeroed: their values do not change the cost), writes a LoRA of `--rank` over every linear layer of the
blocks (the layers the Lightning LoRAs adapt: 14 per block) in the diffusers layout, then times
read_lora + plan_updates + merge_updates where the weights live. Prints the time per block and
the estimate for the 60-block model, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ditfleet.model.qwen_image.lora import LoraSpec, merge_updates, plan_updates, read_lora  # noqa: E402
from ditfleet.model.qwen_image.published import published_config  # noqa: E402
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig  # noqa: E402

FULL_DEPTH = 60


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32

    config = TransformerConfig.from_dict(
        {**published_config("qwen-image", "transformer/config.json"), "num_layers": args.layers}
    )
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    # The weights' values do not change the merge's cost: allocate them, zeroed, without init.
    model = model.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    for t in [*model.parameters(), *model.buffers()]:
        t.zero_()
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("transformer_blocks."):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(
                args.rank, m.in_features, generator=g
            ).bfloat16()
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(
                m.out_features, args.rank, generator=g
            ).bfloat16()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter.safetensors"
        save_file(sd, str(path))
        file_mb = path.stat().st_size / 1e6
        t0 = time.perf_counter()
        lora = read_lora(LoraSpec(str(path)))
        t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    updates = plan_updates([lora], model)
    t_plan = time.perf_counter() - t0
    _sync(device)
    t0 = time.perf_counter()
    merge_updates(model, updates)
    _sync(device)
    t_merge = time.perf_counter() - t0
    per_block = (t_read + t_plan + t_merge) / args.layers
    result = {
        "bench": "lora_merge",
        "device": str(device),
        "dtype": args.dtype,
        "threads": args.threads,
        "layers": args.layers,
        "rank": args.rank,
        "adapted_layers": len(updates),
        "adapter_mb": round(file_mb, 1),
        "read_s": round(t_read, 3),
        "plan_s": round(t_plan, 4),
        "merge_s": round(t_merge, 3),
        "seconds_per_block": round(per_block, 3),
        "estimate_60_blocks_s": round(per_block * FULL_DEPTH, 1),
    }
    print(
        f"{len(updates)} layers, rank {args.rank}, {file_mb:.0f} MB adapter on {device} {args.dtype}: "
        f"read {t_read:.2f} s, match {t_plan * 1e3:.1f} ms, merge {t_merge:.2f} s; "
        f"{per_block:.2f} s per block, about {per_block * FULL_DEPTH:.0f} s for the 60-block model"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
