"""Prompt adherence of a model on the 64 held-out captions, through the real pipeline.

    python -m recipes.tiny.evaluate --model tiny --steps 20 --cfg 2 [--sheet sheet.png]
    python -m recipes.tiny.evaluate --edit --model tiny-edit --steps 20 --cfg 2 [--sheet sheet.png]

Each caption gets a fixed seed (its index), so the numbers are reproducible. `--sheet` also writes a
contact sheet: per bucket, the first held-out captions' images, each above the ideal scene it was
asked for. `--edit` judges an edit model instead on the 64 held-out edits (model.tiny.edits:
each held-out scene, drawn centred at the bucket's size, with one instruction): the share that
shows the instruction and keeps the rest (model.tiny.edit_adherence); its sheet has each source
above its edit and the ideal target.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time

import torch

from ditfleet.model.tiny.adherence import generate_held_out, score
from ditfleet.model.tiny.edit_adherence import edit_score, source_pixels
from ditfleet.model.tiny.edits import Edit, held_out_edits, render_pairs
from ditfleet.model.tiny.scenes import TINY_BUCKETS, Scene, parse_caption, render

SHEET_COLUMNS = 8


def _to_pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray((image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())


def picture_sheet(bands: list[list[tuple[list[torch.Tensor], str]]]):
    """A PIL image: one band per list of cells, `SHEET_COLUMNS` cells a band, each cell its
    pictures (3, H, W) in [0, 1] one above the other and its text under them."""
    from PIL import Image, ImageDraw  # only the sheet needs Pillow

    sizes = [
        (int(cells[0][0][0].shape[1]), int(cells[0][0][0].shape[2]), len(cells[0][0])) for cells in bands
    ]
    cell_w = max(w for _, w, _ in sizes) + 8
    text_h = 40
    heights = [n * h + text_h + 12 for h, _, n in sizes]
    sheet = Image.new("RGB", (SHEET_COLUMNS * cell_w, sum(heights)), "white")
    draw = ImageDraw.Draw(sheet)
    y = 0
    for cells, (h, _, n), band in zip(bands, sizes, heights):
        for i, (pictures, text) in enumerate(cells[:SHEET_COLUMNS]):
            x = i * cell_w + 4
            for row, picture in enumerate(pictures):
                sheet.paste(_to_pil(picture), (x, y + 4 + row * (h + 2)))
            lines = textwrap.wrap(text, width=cell_w // 6)[:4]
            draw.multiline_text((x, y + 4 + n * (h + 2)), "\n".join(lines), fill="black", spacing=1)
        y += band
    return sheet


def contact_sheet(rows: list[tuple[torch.Tensor, list[str]]]):
    """One band per bucket: `SHEET_COLUMNS` generated images, the ideal scene under each, and the
    caption under both. rows: (images (B, 3, H, W) in [0, 1], captions) per bucket."""
    return picture_sheet(
        [
            [
                ([image, render(parse_caption(caption), image.shape[2], image.shape[1])], caption)
                for image, caption in zip(images[:SHEET_COLUMNS], captions)
            ]
            for images, captions in rows
        ]
    )


def edit_sheet(rows: list[tuple[torch.Tensor, list[tuple[Scene, Edit]]]]):
    """One band per bucket: `SHEET_COLUMNS` held-out edits, each as its source, the edit model's
    image and the ideal target, with the instruction under them."""
    bands = []
    for images, pairs in rows:
        sources, targets = render_pairs(pairs[:SHEET_COLUMNS], int(images.shape[3]), int(images.shape[2]))
        cells = zip(sources, images, targets, pairs)
        bands.append(
            [([source, image, target], edit.instruction) for source, image, target, (_, edit) in cells]
        )
    return picture_sheet(bands)


def held_out_edit_images(
    pipe,
    steps: int,
    true_cfg_scale: float,
    width: int,
    height: int,
    pairs: list | None = None,
    **batching: int,
) -> tuple[torch.Tensor, list[tuple[Scene, Edit]]]:
    """The edit model's images (B, 3, height, width) in [0, 1] of `pairs` (default: the 64
    held-out edits), each source an 8-bit RGB picture of its scene at width x height (what a job
    decodes), seeds seed + index; `batching`: generate_held_out's batch_size and seed."""
    from PIL import Image

    pairs = held_out_edits() if pairs is None else pairs
    pixels = source_pixels(pairs, width, height)
    images, _ = generate_held_out(
        pipe,
        steps,
        true_cfg_scale,
        width,
        height,
        prompts=[edit.instruction for _, edit in pairs],
        sources=[[Image.fromarray(p.numpy(), "RGB")] for p in pixels],
        **batching,
    )
    return images, pairs


def main(argv: list[str] | None = None) -> None:
    from ditfleet.model import load_pipeline

    parser = argparse.ArgumentParser(description="Adherence of a model on the held-out scene captions.")
    parser.add_argument("--model", default="tiny", help="'tiny', 'tiny-edit' or a diffusers-layout folder")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--cfg",
        type=float,
        default=2.0,
        help="true_cfg_scale (2: where the tiny model does best; the README job uses it)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sheet", default=None, help="also write a contact sheet (PNG) here")
    parser.add_argument("--edit", action="store_true", help="judge an edit model on the held-out edits")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, modulation_cache="cfg")
    rows: list = []
    for width, height in TINY_BUCKETS:
        start = time.time()
        if args.edit:
            images, pairs = held_out_edit_images(pipe, args.steps, args.cfg, width, height)
            result = edit_score(images, pairs)
            rows.append((images, pairs))
        else:
            images, captions = generate_held_out(pipe, args.steps, args.cfg, width, height)
            result = score(images, captions)
            rows.append((images, captions))
        print(
            json.dumps(
                {
                    "bucket": f"{width}x{height}",
                    "steps": args.steps,
                    "cfg": args.cfg,
                    **{k: round(v, 4) for k, v in result.items()},
                    "seconds": round(time.time() - start, 1),
                }
            )
        )
    if args.sheet:
        (edit_sheet if args.edit else contact_sheet)(rows).save(args.sheet)
        print(f"contact sheet: {args.sheet}")


if __name__ == "__main__":
    main()
