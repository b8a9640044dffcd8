"""What an edit costs per image against the text job at the same size, side by side in one run.

An edit's sources are extra image tokens in every DiT forward (each at the VAE's source size,
model.qwen_image.edit.source_tokens: a 1024 x 1024 area whatever the target's size), extra prompt
tokens where Qwen2.5-VL sees them (EditStyle.prompt_tokens: 203 a source for Edit-2509/2511), and
one VAE encode per source.

1. Measured at toy widths on the CPU: a random Qwen-Image-Edit-2509 checkpoint
   (ditfleet.testing.models.write_toy_edit_checkpoint; its tiny text encoder cannot see images,
   so the sources reach the DiT as latent tokens only), the text job (the same weights run as
   text-to-image) against edits with 1 and 2 sources of the target's size, the VAE's source area
   set to the target's (as a 1024 x 1024 edit is); CPU ms per image (process time, median of
   --repeat), split into encode (prompt and sources), denoise and decode, beside the formula's
   denoise ratio at these widths.
2. Estimated at the published widths from FLOPs (the family's `forward_flops`, with the sources):
   GFLOPs per forward and their ratio to the text job, then the H100 at the 57% of its bf16
   datasheet peak that the compiled DiT measured (docs/performance.md "What an image costs"):
   s per image at --steps steps with CFG (two forwards a step, the negative branch sees the
   sources too), images per GPU-hour, dollars per million at --gpu-hour-usd. The VAE encode is
   counted by torch's FLOP counter on the meta device at the same efficiency (a floor: the VAE
   runs further from peak than the DiT's GEMMs); the decode is left out as in that table.

    python bench/edit_cost.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from ditfleet.driver.output.cost import HOUR_S, usd_per_million
from ditfleet.model.family import load_pipeline, model_family
from ditfleet.model.generation.pipeline import Sampling
from ditfleet.model.qwen_image.edit import EDIT_STYLES, source_size
from ditfleet.model.qwen_image.family import forward_flops
from ditfleet.model.qwen_image.memory_activations import image_tokens
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.testing.models import write_toy_edit_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench/ as a package
from bench.vqa_cost import cpu_ms  # noqa: E402 - CPU time of this process, median of repeats

H100_BF16_PEAK_TFLOPS = 989.0  # dense, SXM datasheet (bench/dit_forward.py's table)
MEASURED_SHARE_OF_PEAK = 0.57  # the compiled DiT's 125 ms at 1024x1024 on an H200 (docs/performance.md)
PLUS = EDIT_STYLES["QwenImageEditPlusPipeline"]
SOURCES = (0, 1, 2)
FAMILY = model_family("tiny")  # Qwen-Image's family: the toy and the published checkpoints share it


def measured(size: int, steps: int, repeat: int) -> dict[str, Any]:
    """Part 1: CPU ms per image at toy widths, text and edits, each phase."""
    root = write_toy_edit_checkpoint(Path(tempfile.mkdtemp(prefix="edit-cost-")) / "edit")
    pipe = load_pipeline(root, "cpu", torch.float32)
    assert pipe.edit is not None
    style = dataclasses.replace(pipe.edit, vae_area=size * size)  # a source at the target's size
    image = Image.new("RGB", (size, size), (200, 40, 40))
    prompt, negative = ["make the shape blue"], " "
    config = json.loads((root / "transformer" / "config.json").read_text())
    dit = TransformerConfig.from_dict(config)
    rows: dict[str, Any] = {}
    for n in SOURCES:
        # The text job is the same pipeline without its edit conditioning: the same weights.
        pipe.edit = style if n else None
        sources = [[image] * n] if n else None
        encode = lambda: pipe.encode_guidance(prompt, negative, 4.0, sources=sources)  # noqa: B023, E731
        inputs = encode()
        sampling = Sampling(size, size, steps, [0], 4.0)
        text_tokens = int(inputs["prompt_embeds"].shape[1])  # type: ignore[union-attr]
        row = {
            "encode_ms": cpu_ms(encode, repeat),
            "denoise_ms": cpu_ms(lambda: pipe.run(inputs, sampling, decode=False), repeat),  # noqa: B023
            "image_ms": cpu_ms(lambda: pipe.run(inputs, sampling), repeat),  # noqa: B023
            # The toy's sources are encoded at the target's area, not the published one the
            # family's forward_flops(..., sources=) assumes: its tokens given directly.
            "forward_flops": forward_flops(dit, (1 + n) * image_tokens(size, size), text_tokens)["total"],
        }
        row["decode_ms"] = row["image_ms"] - row["denoise_ms"]
        row["image_ms"] += row["encode_ms"]
        rows[f"{n} source{'s' * (n > 1)}" if n else "text"] = row
    text = rows["text"]
    for row in rows.values():
        row["image_ratio"] = row["image_ms"] / text["image_ms"]
        row["denoise_ratio"] = row["denoise_ms"] / text["denoise_ms"]
        row["flops_ratio"] = row["forward_flops"] / text["forward_flops"]
    return {"size": size, "steps": steps, "cfg": True, "dit": config, "rows": rows}


def vae_encode_flops(width: int, height: int) -> int:
    """torch's FLOP count of the published VAE's encode of one width x height source, on the meta
    device (shapes only)."""
    vae = FAMILY.empty_vae(FAMILY.published_config("vae/config.json"))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.encode(torch.empty(1, 3, height, width, device="meta"))
    return counter.get_total_flops()


def estimated(
    sizes: tuple[int, ...], text_tokens: int, steps: int, gpu_hour_usd: float
) -> list[dict[str, Any]]:
    """Part 2: per published size and source count, FLOPs and the H100 estimate."""
    config = FAMILY.published_config("transformer/config.json")
    flop_s = MEASURED_SHARE_OF_PEAK * H100_BF16_PEAK_TFLOPS * 1e12
    out = []
    for size in sizes:
        encode = vae_encode_flops(*source_size(size, size))
        text_flops = None
        for n in SOURCES:
            # Qwen2.5-VL's vision tokens of each source join the prompt the DiT sees (Edit-2509).
            tokens = text_tokens + n * PLUS.prompt_tokens(size, size)
            flops = FAMILY.forward_flops(config, size, size, tokens, [(size, size)] * n)
            text_flops = text_flops or flops
            forward_ms = flops / flop_s * 1000
            seconds = (steps * 2 * flops + n * encode) / flop_s
            out.append(
                {
                    "size": f"{size}x{size}",
                    "sources": n,
                    "text_tokens": tokens,
                    "gflop_per_forward": round(flops / 1e9),
                    "ratio_to_text": round(flops / text_flops, 3),
                    "vae_encode_gflop": round(n * encode / 1e9),
                    "h100_ms_per_forward": round(forward_ms, 1),
                    "h100_s_per_image": round(seconds, 2),
                    "images_per_gpu_hour": round(HOUR_S / seconds),
                    "usd_per_million": round(usd_per_million(seconds, gpu_hour_usd) or 0.0),
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256, help="toy run's target (and source) side, pixels")
    p.add_argument("--toy-steps", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=50, help="steps of the published-width estimate")
    p.add_argument("--text-tokens", type=int, default=64, help="the instruction's prompt tokens")
    p.add_argument("--gpu-hour-usd", type=float, default=2.0)
    args = p.parse_args()
    torch.manual_seed(0)
    toy = measured(args.size, args.toy_steps, args.repeat)
    table = estimated((1024, 1328), args.text_tokens, args.steps, args.gpu_hour_usd)

    print(
        f"1. measured, toy widths on the CPU ({args.size}x{args.size}, {args.toy_steps} steps with CFG, "
        f"sources of the target's size), ms per image (CPU time, median of {args.repeat}):"
    )
    print("   job         encode  denoise  decode   image  ratio  denoise ratio  formula's")
    for name, r in toy["rows"].items():
        print(
            f"   {name:<10} {r['encode_ms']:7.0f} {r['denoise_ms']:8.0f} {r['decode_ms']:7.0f} "
            f"{r['image_ms']:7.0f} {r['image_ratio']:6.2f} {r['denoise_ratio']:14.2f} {r['flops_ratio']:10.2f}"
        )
    print(
        f"2. estimated, published widths: H100 at {MEASURED_SHARE_OF_PEAK:.0%} of {H100_BF16_PEAK_TFLOPS:g} "
        f"TFLOP/s, {args.steps} steps with CFG, ${args.gpu_hour_usd:g} per GPU-hour, decode left out:"
    )
    print("   size        sources  GFLOP/forward  ratio  ms/forward  s/image  images/GPU-h  $/million")
    for r in table:
        print(
            f"   {r['size']:<11} {r['sources']:7d} {r['gflop_per_forward']:14,d} {r['ratio_to_text']:6.2f} "
            f"{r['h100_ms_per_forward']:11.1f} {r['h100_s_per_image']:8.2f} {r['images_per_gpu_hour']:13,d} "
            f"{r['usd_per_million']:10,d}"
        )
    print(json.dumps({"bench": "edit_cost", "toy": toy, "published": table}))


if __name__ == "__main__":
    main()
