"""A contact sheet of an output: a grid of generated images, each captioned with its prompt; an
edit job's image next to its source images (jobs.source_images: a source that cannot be read is
a labelled blank).

Reads manifests shard by shard until it has enough ok images, then reads those images through
their format's reader (workers.output.formats), each stored object once. Sorted by a score
(`--sort tiny`), it reads every manifest's id, k, uri and score columns first (an image's score is
found by its id and k: a "parquet" or "webdataset" shard's rows share one uri), then only the
images shown.
"""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass, field
from typing import NamedTuple

import pyarrow as pa
from PIL import Image, ImageDraw, ImageFont

from ditfleet.jobs.source_images import SourceImage, SourceImages, source_reader
from ditfleet.workers.output.formats import MANIFEST_IMAGE_COLUMNS, ManifestImage, ok_images, read_images
from ditfleet.workers.output.layout import score_table_key
from ditfleet.workers.output.manifest import current_manifest_keys
from ditfleet.workers.output.score_table import score_tables
from ditfleet.workers.storage import ObjectStore
from ditfleet.workers.storage.parquet_bytes import read_parquet

_COLUMNS = [*MANIFEST_IMAGE_COLUMNS, "prompt"]
_SOURCES = "source_uris"  # an edit job's; absent from manifests written before edit jobs
THUMB = 160  # longest side of a thumbnail, pixels
_CAPTION_CHARS = 26  # per caption line, at the caption font (about 140 of THUMB's 160 px)
_CAPTION_LINES = 4
_PAD = 8


@dataclass(frozen=True)
class PreviewImage:
    id: str
    k: int
    prompt: str
    image: Image.Image
    score: float | None = None  # with --sort: the score it was sorted by
    sources: tuple[SourceImage, ...] = ()  # an edit's source images, in column order


@dataclass(frozen=True)
class ScoredImages:
    """What `scored_rows` found: (score, row, prompt) of every ok image with a score, in shard
    order, and a line naming the shards whose images have none because `ditfleet score` has not
    scored their current generation (a redo since), or None."""

    rows: list[tuple[float, ManifestImage, str]]
    behind: str | None = None
    sources: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)  # edit rows' source_uris


def _by_image(table: pa.Table, column: str) -> dict[tuple[str, int, str], float | None]:
    """(id, k, uri) -> the row's `column`: an image is its (id, k), and the uri its generation's
    object (every row of a "parquet" or "webdataset" shard shares one, so it is no key alone)."""
    return dict(zip(zip(*(table[c].to_pylist() for c in ("id", "k", "uri"))), table[column].to_pylist()))


def scored_rows(store: ObjectStore, scorer: str) -> ScoredImages:
    """Every ok image with a `scorer` score: the manifest's score_{name} column (quality.scorers),
    else the side table `ditfleet score` made from that manifest's generation."""
    found = []
    column = f"score_{scorer}"
    current = current_manifest_keys(store)
    tables = score_tables(store, scorer, current)  # one listing: which manifests have a table
    without = []  # shards whose images got a score from neither place
    sources: dict[tuple[str, int], tuple[str, ...]] = {}
    for shard, key in sorted(current.items()):
        table = read_parquet(store.get(key), _COLUMNS, if_present=[column, _SOURCES])
        sources |= source_uris_of(table)
        scores = _by_image(table, column) if column in table.column_names else {}
        if not any(v is not None for v in scores.values()):
            if key in tables.made:
                side = read_parquet(store.get(score_table_key(scorer, key)), ["id", "k", "uri", "score"])
                scores = _by_image(side, "score")
            else:
                without.append(shard)
        prompts = {(r["id"], r["k"]): r["prompt"] for r in table.select(["id", "k", "prompt"]).to_pylist()}
        for row in ok_images(table):
            if (value := scores.get((row.id, row.k, row.uri))) is not None:
                found.append((value, row, prompts[(row.id, row.k)]))
    # Only where side tables are what this scorer's scores come from: a job's own scorer can
    # leave images unscored (null) without any table being behind.
    behind = tables.note(store.uri(), without) if (tables.made or tables.stale) else None
    return ScoredImages(found, behind, sources)


def source_uris_of(table: pa.Table) -> dict[tuple[str, int], tuple[str, ...]]:
    """(id, k) -> the source URIs of a manifest's edit rows (none for a text job's)."""
    if _SOURCES not in table.column_names:
        return {}
    rows = zip(table["id"].to_pylist(), table["k"].to_pylist(), table[_SOURCES].to_pylist())
    return {(i, k): tuple(uris) for i, k, uris in rows if uris}


def collect_sorted(
    store: ObjectStore, limit: int, scorer: str, best: bool = False, sources: SourceImages | None = None
) -> list[PreviewImage]:
    """Up to `limit` scored images, lowest score first (best: highest first); ties in shard order."""
    return _sorted_images(store, scored_rows(store, scorer), limit, best, sources)


def _sorted_images(
    store: ObjectStore, scored: ScoredImages, limit: int, best: bool, sources: SourceImages | None = None
) -> list[PreviewImage]:
    ranked = sorted(scored.rows, key=lambda t: -t[0] if best else t[0])[:limit]
    blobs = read_images(store, [row for _, row, _ in ranked])
    reader = sources or SourceImages()
    return [
        PreviewImage(
            row.id,
            row.k,
            prompt,
            Image.open(io.BytesIO(blob)).convert("RGB"),
            value,
            reader.read(scored.sources.get((row.id, row.k), ())),
        )
        for (value, row, prompt), (_, blob) in zip(ranked, blobs)
    ]


def collect(store: ObjectStore, limit: int, sources: SourceImages | None = None) -> list[PreviewImage]:
    """Up to `limit` ok images of the output, in shard order, an edit's with its sources (read by
    `sources`: the S3 options and the job's image column)."""
    picked: list[PreviewImage] = []
    reader = sources or SourceImages()
    current = current_manifest_keys(store)  # a redone shard's latest generation
    for shard in sorted(current):
        if len(picked) >= limit:
            break
        table = read_parquet(store.get(current[shard]), _COLUMNS, if_present=[_SOURCES])
        prompts = {(r["id"], r["k"]): r["prompt"] for r in table.select(["id", "k", "prompt"]).to_pylist()}
        uris = source_uris_of(table)
        rows = ok_images(table)[: limit - len(picked)]
        for row, blob in read_images(store, rows):
            image = Image.open(io.BytesIO(blob)).convert("RGB")
            edit_of = reader.read(uris.get((row.id, row.k), ()))
            picked.append(PreviewImage(row.id, row.k, prompts[(row.id, row.k)], image, sources=edit_of))
    return picked


def caption_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's bundled font at 12 px: at its default 10 px whole-pixel advances squeeze some word
    spaces to a pixel ("smallyellow"), so captions read unevenly. The same font on every machine."""
    return ImageFont.load_default(size=12)


def contact_sheet(images: list[PreviewImage], columns: int | None = None) -> Image.Image:
    """A grid: each cell the image (fit into THUMB x THUMB) over its id and wrapped prompt; an
    edit's cell has its sources first, in column order, then the edited image, in the last place
    (so the results line up), a source that cannot be shown a grey box saying why."""
    if not images:
        raise ValueError("no images to show")
    cols = columns or min(len(images), max(1, math.ceil(math.sqrt(len(images)))))
    rows = math.ceil(len(images) / cols)
    font = caption_font()
    line_h = 15
    panels = 1 + max(len(item.sources) for item in images)
    cell_w, cell_h = panels * (THUMB + _PAD) + _PAD, THUMB + 2 * _PAD + line_h * (_CAPTION_LINES + 1)
    sheet = Image.new("RGB", (cols * cell_w, rows * cell_h), "white")
    draw = ImageDraw.Draw(sheet)
    for n, item in enumerate(images):
        x0, y0 = (n % cols) * cell_w + _PAD, (n // cols) * cell_h + _PAD
        for i, source in enumerate(item.sources):
            _panel(sheet, draw, font, source.image, (x0 + i * (THUMB + _PAD), y0), _blank_text(i, source))
        _panel(sheet, draw, font, item.image, (x0 + (panels - 1) * (THUMB + _PAD), y0), "")
        label = item.id if item.k == 0 else f"{item.id} #{item.k}"
        label += "" if item.score is None else f"  {item.score:.3g}"
        if item.sources:
            label += f"  (edit of {len(item.sources)} source{'s' if len(item.sources) > 1 else ''})"
        wrap = _CAPTION_CHARS * (1 + (panels - 1) * (THUMB + _PAD) // THUMB)
        lines = [label, *textwrap.wrap(item.prompt, wrap)[:_CAPTION_LINES]]
        for i, text in enumerate(lines):
            draw.text((x0, y0 + THUMB + 4 + i * line_h), text, fill="black" if i else "gray", font=font)
    return sheet


def _blank_text(i: int, source: SourceImage) -> str:
    """What a source's blank says: which source, its URI's last part and why it is not shown."""
    name = source.uri.rstrip("/").rsplit("/", 1)[-1]
    return f"source {i + 1}: {source.problem}\n{name}"


def _panel(
    sheet: Image.Image,
    draw: ImageDraw.ImageDraw,
    font: ImageFont.FreeTypeFont | ImageFont.ImageFont,
    image: Image.Image | None,
    at: tuple[int, int],
    blank: str,
) -> None:
    """`image` fit into THUMB x THUMB at `at` (its top left), or a grey box with `blank` in it."""
    x0, y0 = at
    if image is None:
        draw.rectangle((x0, y0, x0 + THUMB - 1, y0 + THUMB - 1), fill="#e6e6e6", outline="#b0b0b0")
        lines = [w for part in blank.split("\n") for w in textwrap.wrap(part, _CAPTION_CHARS - 2)][:8]
        for i, text in enumerate(lines):
            draw.text((x0 + 6, y0 + 6 + i * 15), text, fill="#b42318" if i == 0 else "#444", font=font)
        return
    thumb = image.copy()
    thumb.thumbnail((THUMB, THUMB))
    sheet.paste(thumb, (x0 + (THUMB - thumb.width) // 2, y0 + (THUMB - thumb.height) // 2))


class PreviewWritten(NamedTuple):
    shown: int  # images on the sheet
    note: str | None = None  # with sort: the shards whose images have no score (ScoredImages.behind)


def write_preview(
    store: ObjectStore,
    out_path: str,
    limit: int = 24,
    columns: int | None = None,
    sort: str | None = None,
    best: bool = False,
    sources: SourceImages | None = None,
) -> PreviewWritten:
    """Write a contact sheet PNG of up to `limit` images to `out_path`.
    sort: a scorer's name: the images with that score, lowest first (best: highest first).
    sources: reads an edit job's sources (default: no S3 options, the job's image column)."""
    sources = sources or source_reader(store)
    scored = scored_rows(store, sort) if sort is not None else None
    images = (
        collect(store, limit, sources)
        if scored is None
        else _sorted_images(store, scored, limit, best, sources)
    )
    if not images and sort is not None:
        raise ValueError(
            f"{store.uri()} has no image with a {sort!r} score: run the job with quality.scorers: "
            f"[{sort}], or `ditfleet score {store.uri()} --scorer {sort}`"
        )
    if not images:
        raise ValueError(f"{store.uri()} has no committed ok images yet; run the job first")
    contact_sheet(images, columns).save(out_path, format="PNG")
    return PreviewWritten(len(images), scored.behind if scored is not None else None)
