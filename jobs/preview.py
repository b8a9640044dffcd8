"""A contact sheet of an output: a grid of generated images, each captioned with its prompt.

Reads manifests shard by shard until it has enough ok images, then reads those images through
their format's reader (workers.output.formats), each stored object once.
"""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass

import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from ditfleet.workers.output.formats import MANIFEST_IMAGE_COLUMNS, ok_images, read_images
from ditfleet.workers.output.manifest import current_manifest_keys
from ditfleet.workers.storage import ObjectStore

_COLUMNS = [*MANIFEST_IMAGE_COLUMNS, "prompt"]
THUMB = 160  # longest side of a thumbnail, pixels
_CAPTION_CHARS = 26  # per caption line, at the default font
_CAPTION_LINES = 4
_PAD = 8


@dataclass(frozen=True)
class PreviewImage:
    id: str
    k: int
    prompt: str
    image: Image.Image


def collect(store: ObjectStore, limit: int) -> list[PreviewImage]:
    """Up to `limit` ok images of the output, in shard order."""
    picked: list[PreviewImage] = []
    current = current_manifest_keys(store)  # a redone shard's latest generation
    for shard in sorted(current):
        if len(picked) >= limit:
            break
        table = pq.read_table(io.BytesIO(store.get(current[shard])), columns=_COLUMNS)
        prompts = {(r["id"], r["k"]): r["prompt"] for r in table.select(["id", "k", "prompt"]).to_pylist()}
        rows = ok_images(table)[: limit - len(picked)]
        for row, blob in read_images(store, rows):
            image = Image.open(io.BytesIO(blob)).convert("RGB")
            picked.append(PreviewImage(row.id, row.k, prompts[(row.id, row.k)], image))
    return picked


def contact_sheet(images: list[PreviewImage], columns: int | None = None) -> Image.Image:
    """A grid: each cell the image (fit into THUMB x THUMB) over its id and wrapped prompt."""
    if not images:
        raise ValueError("no images to show")
    cols = columns or min(len(images), max(1, math.ceil(math.sqrt(len(images)))))
    rows = math.ceil(len(images) / cols)
    font = ImageFont.load_default()
    line_h = 12
    cell_w, cell_h = THUMB + 2 * _PAD, THUMB + 2 * _PAD + line_h * (_CAPTION_LINES + 1)
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for n, item in enumerate(images):
        x0, y0 = (n % cols) * cell_w + _PAD, (n // cols) * cell_h + _PAD
        thumb = item.image.copy()
        thumb.thumbnail((THUMB, THUMB))
        sheet.paste(thumb, (x0 + (THUMB - thumb.width) // 2, y0 + (THUMB - thumb.height) // 2))
        label = item.id if item.k == 0 else f"{item.id} #{item.k}"
        lines = [label, *textwrap.wrap(item.prompt, _CAPTION_CHARS)[:_CAPTION_LINES]]
        for i, text in enumerate(lines):
            draw.text((x0, y0 + THUMB + 4 + i * line_h), text, fill="black" if i else "gray", font=font)
    return sheet


def write_preview(store: ObjectStore, out_path: str, limit: int = 24, columns: int | None = None) -> int:
    """Write a contact sheet PNG of up to `limit` images to `out_path`; returns how many it shows."""
    images = collect(store, limit)
    if not images:
        raise ValueError(f"{store.uri()} has no committed ok images yet; run the job first")
    contact_sheet(images, columns).save(out_path, format="PNG")
    return len(images)
