"""The report's images: small JPEG thumbnails as data: URIs, each in a captioned cell (jobs.report)."""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass

from PIL import Image

THUMB = 128  # longest side of a thumbnail on the page, pixels


@dataclass(frozen=True)
class Thumbnail:
    label: str  # the image's id (and '#k' for a row's later images)
    caption: str  # under the label: the prompt, or a score and the prompt
    jpeg: bytes
    shown: tuple[int, int]  # (width, height) on the page: the image fit into THUMB x THUMB


def thumbnail(image: Image.Image, row_id: str, k: int, caption: str) -> Thumbnail:
    small = image.copy()
    small.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    small.convert("RGB").save(buf, format="JPEG", quality=85)
    scale = THUMB / max(image.size)  # small images are shown enlarged, pixelated
    shown = (round(image.width * scale), round(image.height * scale))
    return Thumbnail(row_id if k == 0 else f"{row_id} #{k}", caption, buf.getvalue(), shown)


def image_cells(thumbs: list[Thumbnail]) -> str:
    return "".join(
        f'<div class="cell"><img src="data:image/jpeg;base64,{base64.b64encode(t.jpeg).decode()}" '
        f'width="{t.shown[0]}" height="{t.shown[1]}" alt="{html.escape(t.label)}"><b>{html.escape(t.label)}</b>'
        f"<br>{html.escape(t.caption)}</div>"
        for t in thumbs
    )
