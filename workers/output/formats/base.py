"""What every output format shares: the image task, the stored-shard result, the writer protocol,
the encode step and the record a format module declares itself with (OutputFormat); and, for reading an output back, the manifest row a
reader looks for (ManifestImage), what one read of a stored object gives (StoredImages) and the
reader protocol.

Each writer takes images one at a time (`add`), encodes and stores them on a bounded UploadPool
(running the caller's host work for the image there too), and `finish` returns one ImageResult
per image, in the order added: the caller zips them with what it added. Nothing here writes the
manifest: the caller turns results into manifest rows and commits them after `finish`
returned, i.e. after every image is durably stored.

Every writer is made for one run of one shard and writes only keys that carry the run's attempt
token, so the objects a committed manifest names never change (layout.py: attempt-scoped objects).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from ditfleet.model.knobs import bounded, setting
from ditfleet.workers.output.codec import encode_image, sha256_hex, to_uint8_hwc
from ditfleet.workers.output.layout import ImageFormat, ShardObjects
from ditfleet.workers.output.provenance import JobProvenance, Provenance
from ditfleet.workers.output.upload_pool import ImageResult
from ditfleet.workers.storage.base import ObjectStore

_MiB = 1024 * 1024


@dataclass(frozen=True)
class WriterSettings:
    """How a writer stores images, whatever the format (ShardWriterConfig adds which format).
    Sizes in bytes. The plan's fingerprint records the knobs marked `fingerprint`, and
    embed_metadata with the job's name when it is on (JobSpec.image_settings)."""

    image_format: ImageFormat = setting(
        "png",
        fingerprint="always",
        description="Image encoding: png (lossless), webp or jpeg (smaller, lossy).",
    )
    quality: int | None = setting(
        None,
        ge=1,
        le=100,
        fingerprint="always",
        description="webp/jpeg quality 1..100; null: the codec's default. Not for png.",
    )
    embed_metadata: bool = setting(
        True,
        description="Write each image's provenance into the file itself: prompt, negative prompt, seed, "
        "steps, CFG scale, size, model id and revision, job name (PNG: a `parameters` text chunk as "
        "AUTOMATIC1111 writes it and a `ditfleet` JSON chunk; JPEG and WebP: EXIF and XMP). A pure "
        "function of the row's settings: the same job makes the same bytes. false: no metadata.",
    )
    # The model and job every image's metadata names (the actor fills in the model it loaded).
    job: JobProvenance = field(default_factory=JobProvenance)
    png_compress_level: int = 6
    max_in_flight: int = bounded(32, ge=1)  # images held by the pool at once: the memory bound
    threads: int = bounded(8, ge=1)  # encode+upload threads
    row_group_rows: int = bounded(64, ge=1)  # "parquet": a row group closes at this many images ...
    row_group_bytes: int = bounded(64 * _MiB, ge=1)  # ... or this many image bytes, whichever comes first
    spool_max_bytes: int = 256 * _MiB  # "parquet"/"webdataset": the file spills to a temp file above this
    tmp_dir: str | None = None  # where it spills (None = the system's temp dir)


@dataclass(frozen=True, kw_only=True)
class ImageTask:
    """One image to store and what the "parquet" format keeps next to it."""

    id: str
    k: int = 0
    num_images: int = 1  # images of this row; with 1 the file name carries no _k suffix
    prompt: str = ""
    negative_prompt: str | None = None
    seed: int = 0
    extra: str | None = None  # pass-through columns as JSON (manifest.passthrough_json)
    steps: int | None = None  # the row's sampling steps and CFG scale, for the image's metadata
    true_cfg_scale: float | None = None
    # An edit job's source images, (uri, sha256) each in column order, for the image's metadata
    # (the manifest row names them too); None: a text job.
    sources: tuple[tuple[str, str], ...] | None = None

    def provenance(self, job: JobProvenance, width: int, height: int) -> Provenance:
        """What the stored image's metadata says made it; width, height: its pixels."""
        return Provenance(
            **self.fields(width, height),
            steps=self.steps,
            true_cfg_scale=self.true_cfg_scale,
            job=job,
            sources=self.sources,
        )

    def fields(self, width: int, height: int) -> dict[str, Any]:
        """What the "parquet" and "webdataset" formats store next to the image (in this order);
        width, height: the stored image's pixels."""
        return {
            "id": self.id,
            "k": self.k,
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "seed": self.seed,
            "width": width,
            "height": height,
        }


@dataclass(frozen=True)
class StoredShard:
    """What `finish` returns: one result per image (order of `add`), the data file if any."""

    results: list[ImageResult]
    data_uri: str | None = None  # "parquet" and "webdataset" formats
    data_bytes: int = 0
    data_upload_s: float = 0.0
    keys: tuple[str, ...] = ()  # every key this run stored (all carry its attempt token)


class ShardWriter(Protocol):
    def add(self, task: ImageTask, image: Any, host_work: Callable[[], None] | None = None) -> None:
        """Hand over one image ((3, H, W) float in [0, 1] or (H, W, 3) uint8); may block.
        host_work: the caller's CPU work on this image (scores, hash), run on the pool's thread
        before the encode; if it raises, the shard fails as an upload does."""

    def finish(self) -> StoredShard:
        """Wait until every image is stored; raises ShardStoreError if one could not be."""

    def abort(self) -> None:
        """Stop and drop what is not yet stored; leaves no partial object behind."""


def encode_task_image(
    cfg: WriterSettings, task: ImageTask, image: Any
) -> tuple[bytes | None, float, str | None, int, int]:
    """(encoded bytes or None, encode seconds, error, width, height): the task's image, with its
    provenance in the file's metadata unless cfg.embed_metadata is off. Encode problems fail the
    row only."""
    start = time.perf_counter()
    try:
        pixels = to_uint8_hwc(image)  # (H, W, 3) uint8
        height, width = pixels.shape[:2]
        provenance = task.provenance(cfg.job, width, height) if cfg.embed_metadata else None
        data = encode_image(pixels, cfg.image_format, cfg.quality, cfg.png_compress_level, provenance)
    except Exception as e:  # non-finite output, bad shape, a codec error: this row only
        return None, time.perf_counter() - start, f"encode failed: {type(e).__name__}: {e}", 0, 0
    return data, time.perf_counter() - start, None, width, height


# -- reading an output back ------------------------------------------------------------------------

# The manifest columns `ok_images` reads.
MANIFEST_IMAGE_COLUMNS = ["id", "k", "status", "uri", "format", "sha256", "bytes"]


class ManifestImage(NamedTuple):
    """One ok manifest row as a reader needs it: where its image is and what it must be.
    (A tuple: verify makes one per image of the output.)"""

    id: str
    k: int
    uri: str  # the stored object: the image ("files"), the shard's data file or tar
    image_format: str  # the manifest's `format`: png | webp | jpeg
    num_images: int = 1  # rows of this id in its manifest: names inside an object carry k only when > 1
    sha256: str | None = None
    bytes: int | None = None

    @property
    def label(self) -> str:
        return f"id={self.id!r} k={self.k}"


def ok_images(manifest: pa.Table, per_id: Counter | None = None) -> list[ManifestImage]:
    """The ok rows of one shard's manifest (a table with MANIFEST_IMAGE_COLUMNS at least), in
    manifest order. num_images counts every row of the id, failed ones included, as the writer
    did when it named the images; per_id: that count when the caller has it."""
    if per_id is None:
        per_id = Counter(manifest.column("id").to_pylist())
    ok = manifest.filter(pc.equal(manifest.column("status"), "ok"))
    ids = ok.column("id").to_pylist()
    columns = [ok.column(name).to_pylist() for name in ("k", "uri", "format")]
    sizes = [ok.column(name).to_pylist() for name in ("sha256", "bytes")]
    return list(map(ManifestImage._make, zip(ids, *columns, (per_id[i] for i in ids), *sizes)))


class StoredImageError(ValueError):
    """A stored object, or a member of it, cannot be read, or is not what its manifest names.
    The message names the object (and the member or row)."""


@dataclass
class StoredImages:
    """What one read of a stored object gave: the image of each row asked for that it holds,
    and the rows it holds that were not asked for (data files and tars name their rows)."""

    uri: str  # the object read
    images: dict[tuple[str, int], bytes]  # (id, k) -> the stored image bytes
    unnamed: tuple[tuple[str, int], ...] = ()
    whole_object: bool = False  # the object is the image itself ("files"): messages name it alone
    # What a reader of the object would see besides the named images (a row or member twice, a
    # member of no sample, bytes after a tar's end): each one line naming the object. A reader
    # of the format (pyarrow.dataset, webdataset) returns these, so they are findings.
    findings: tuple[str, ...] = ()

    def image(self, row: ManifestImage) -> bytes:
        """The row's image bytes; raises StoredImageError when the object has none for it."""
        data = self.images.get((row.id, row.k))
        if data is None:
            raise StoredImageError(f"{self.uri}: has no image for manifest row {row.label}")
        return data

    def problem(self, row: ManifestImage) -> str | None:
        """None when the row's image is there with the manifest's size and sha256; else what is wrong."""
        data = self.images.get((row.id, row.k))
        if data is None:
            return f"{self.uri}: has no image for manifest row {row.label}"
        digest = sha256_hex(data)
        if len(data) == row.bytes and digest == row.sha256:
            return None
        said = f"{row.bytes} bytes, {(row.sha256 or '')[:16]}..."
        if self.whole_object:
            return f"{self.uri}: {len(data)} bytes with sha256 {digest[:16]}..., the manifest row {row.label} says {said}"
        return (
            f"{self.uri}: image of row {row.label} is {len(data)} bytes with sha256 {digest[:16]}..., "
            f"the manifest says {said}"
        )

    def unnamed_problems(self, most: int = 3) -> list[str]:
        """One line per row the object holds that the rows read do not name (the first `most`),
        then its other findings (the first `most`, and how many more)."""
        lines = [
            f"{self.uri}: holds row id={id_!r} k={k}, which its manifest does not name as ok"
            for id_, k in self.unnamed[:most]
        ]
        if len(self.unnamed) > most:
            lines.append(f"{self.uri}: holds {len(self.unnamed) - most} more rows its manifest does not name")
        lines.extend(self.findings[:most])
        if len(self.findings) > most:
            lines.append(f"{self.uri}: and {len(self.findings) - most} more findings like these")
        return lines


class ShardReader(Protocol):
    """Reads the objects of one output format back (each format module has one)."""

    def read(self, store: ObjectStore, key: str, rows: Sequence[ManifestImage]) -> StoredImages:
        """Read the object at `key` once, for the ok manifest rows that name it. Raises
        ObjectNotFound when it is absent and StoredImageError when it cannot be read."""
        ...


@dataclass(frozen=True)
class OutputFormat:
    """One output format, as its module declares it: the name a job gives (`output.format`), what
    the job file says of it, where its objects lie (`objects`: its area and key shape, which the
    registry reads orphans, supersession and verification by), its writer (made per run of a shard:
    store, shard, config, attempt token) and its reader."""

    name: str
    description: str
    objects: ShardObjects
    writer: Callable[[ObjectStore, int, WriterSettings, str], ShardWriter]
    reader: ShardReader
