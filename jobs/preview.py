"""A contact sheet of an output: a grid of generated images, each captioned with its prompt.

Reads manifests shard by shard until it has enough ok images, then fetches only those images
(their objects in the "files" format; the shard's data file in "parquet", its tar in "webdataset").
"""

from __future__ import annotations

import io
import json
import math
import tarfile
import textwrap
from dataclasses import dataclass

import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFont

from workers.output.layout import DATA_PREFIX, WEBDATASET_PREFIX, manifest_key
from workers.output.manifest import committed_shards
from workers.storage import ObjectStore

_COLUMNS = ["id", "k", "prompt", "status", "uri", "shard", "width", "height"]
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


def _key_of(store: ObjectStore, uri: str) -> str:
    """The store key of a manifest `uri` (which the worker built with store.uri(key))."""
    root = store.uri().rstrip("/")
    if not uri.startswith(root):
        raise ValueError(f"image {uri} is not inside the output {root}; was the output moved?")
    return uri[len(root) :].lstrip("/")


def _images_in_data_file(blob: bytes) -> dict[tuple[str, int], bytes]:
    """(id, k) -> image bytes of a "parquet" format data file."""
    data = pq.read_table(io.BytesIO(blob), columns=["image", "id", "k"])
    return {(r["id"], r["k"]): r["image"]["bytes"] for r in data.to_pylist()}


def _images_in_tar(blob: bytes) -> dict[tuple[str, int], bytes]:
    """(id, k) -> image bytes of a "webdataset" format tar: each {key}.json names its image's id, k."""
    members: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            f = tar.extractfile(member)
            if f is not None:
                members[member.name] = f.read()
    out = {}
    for name, data in members.items():
        if name.endswith(".json"):
            meta = json.loads(data)
            stem = name[: -len(".json")]
            image = next((b for n, b in members.items() if n.startswith(stem + ".") and n != name), None)
            if image is not None:
                out[(meta["id"], meta["k"])] = image
    return out


def collect(store: ObjectStore, limit: int) -> list[PreviewImage]:
    """Up to `limit` ok images of the output, in shard order."""
    picked: list[PreviewImage] = []
    containers: dict[str, dict[tuple[str, int], bytes]] = {}  # data file / tar key -> its images
    for shard in sorted(committed_shards(store)):
        if len(picked) >= limit:
            break
        table = pq.read_table(io.BytesIO(store.get(manifest_key(shard))), columns=_COLUMNS)
        table = table.filter(pc.equal(table.column("status"), "ok")).slice(0, limit - len(picked))
        for row in table.to_pylist():
            key = _key_of(store, row["uri"])
            if key.startswith((DATA_PREFIX, WEBDATASET_PREFIX)):  # images inside one file per shard
                if key not in containers:
                    read = _images_in_data_file if key.startswith(DATA_PREFIX) else _images_in_tar
                    containers[key] = read(store.get(key))
                blob = containers[key][(row["id"], row["k"])]
            else:
                blob = store.get(key)
            image = Image.open(io.BytesIO(blob)).convert("RGB")
            picked.append(PreviewImage(row["id"], row["k"], row["prompt"], image))
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
