"""The report's images: small JPEG thumbnails as data: URIs, each in a captioned cell (jobs.report);
an edit's cell shows its sources, then the edited image."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from ditfleet.jobs.source_images import SourceImage

THUMB = 128  # longest side of a thumbnail on the page, pixels


@dataclass(frozen=True)
class SourceThumbnail:
    """One source of an edited image on the page: its thumbnail, or None and why (a blank)."""

    uri: str
    jpeg: bytes | None
    shown: tuple[int, int]
    problem: str | None = None


@dataclass(frozen=True)
class Thumbnail:
    label: str  # the image's id (and '#k' for a row's later images)
    caption: str  # under the label: the prompt, or a score and the prompt
    jpeg: bytes
    shown: tuple[int, int]  # (width, height) on the page: the image fit into THUMB x THUMB
    sources: tuple[SourceThumbnail, ...] = ()  # an edit's sources, in column order


def _small(image: Image.Image) -> tuple[bytes, tuple[int, int]]:
    """(JPEG bytes, size on the page) of `image` fit into THUMB x THUMB."""
    small = image.copy()
    small.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    small.convert("RGB").save(buf, format="JPEG", quality=85)
    scale = THUMB / max(image.size)  # small images are shown enlarged, pixelated
    return buf.getvalue(), (round(image.width * scale), round(image.height * scale))


def thumbnail(
    image: Image.Image, row_id: str, k: int, caption: str, sources: Sequence[SourceImage] = ()
) -> Thumbnail:
    jpeg, shown = _small(image)
    thumbs = tuple(
        SourceThumbnail(s.uri, None, (THUMB, THUMB), s.problem)
        if s.image is None
        else SourceThumbnail(s.uri, *_small(s.image))
        for s in sources
    )
    return Thumbnail(row_id if k == 0 else f"{row_id} #{k}", caption, jpeg, shown, thumbs)


def _img(jpeg: bytes, shown: tuple[int, int], alt: str, title: str = "") -> str:
    hover = f' title="{html.escape(title)}"' if title else ""
    return (
        f'<img src="data:image/jpeg;base64,{base64.b64encode(jpeg).decode()}" '
        f'width="{shown[0]}" height="{shown[1]}" alt="{html.escape(alt)}"{hover}>'
    )


def _source(i: int, s: SourceThumbnail) -> str:
    if s.jpeg is not None:
        return _img(s.jpeg, s.shown, f"source {i + 1}", s.uri)
    return (
        f'<div class="blank" style="width:{THUMB}px;height:{THUMB}px" title="{html.escape(s.uri)}">'
        f"source {i + 1}: {html.escape(s.problem or 'not shown')}<br>"
        f'<span class="uri">{html.escape(s.uri)}</span></div>'
    )


def image_cells(thumbs: list[Thumbnail]) -> str:
    """A cell per thumbnail: the image (an edit's sources, an arrow, the image), its label and caption."""
    cells = []
    for t in thumbs:
        image = _img(t.jpeg, t.shown, t.label)
        if t.sources:
            sources = "".join(_source(i, s) for i, s in enumerate(t.sources))
            image = f'<div class="pair">{sources}<span class="arrow">&rarr;</span>{image}</div>'
        kind = "cell edit" if t.sources else "cell"
        cells.append(
            f'<div class="{kind}">{image}<b>{html.escape(t.label)}</b><br>{html.escape(t.caption)}</div>'
        )
    return "".join(cells)
