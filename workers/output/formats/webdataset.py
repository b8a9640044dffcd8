"""Output format "webdataset": one tar per shard, two members per image; its writer, its reader and
its registry row (FORMAT).

```
{out}/webdataset/shard-{shard:05d}-{attempt}.tar
    {key}.{png|webp|jpg}    the encoded image (the bytes the manifest's sha256 is of)
    {key}.json              {"id", "k", "prompt", "negative_prompt", "seed", "width", "height", "extra"}
```

`key` is `webdataset_sample_key(id, k)` (free of dots: see there). The two members of a
sample are adjacent, as WebDataset readers require.

Given the same images, the tar is the same bytes on every run of the shard: members are appended
in the order of `add` (encoding runs on the pool's threads, appending on the caller's), and every
header field that could vary (mtime, uid, gid, owner names, mode) is fixed. Each run still writes
its own key (the attempt token in it), since two runs need not make the same pixels. The tar is
stored whole at `finish` (spool.py). Failed rows have no members (the manifest has them). The
manifest rows' `uri` is the tar's URI, as the "parquet" format's is its data file.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from collections.abc import Sequence

from ditfleet.workers.output.formats.base import (
    ImageTask,
    ManifestImage,
    OutputFormat,
    StoredImageError,
    StoredImages,
    WriterSettings,
)
from ditfleet.workers.output.formats.spool import SpooledShardWriter
from ditfleet.workers.output.layout import (
    IMAGE_EXTENSIONS,
    ShardObjects,
    image_index_in_key,
    k_suffix,
    safe_key_component,
)
from ditfleet.workers.storage.base import ObjectStore

# One tar per run of a shard.
OBJECTS = ShardObjects("webdataset/", ".tar")


def webdataset_key(shard: int, attempt: str) -> str:
    """Key of a shard's tar, written by the run `attempt` (its token)."""
    return OBJECTS.key(shard, attempt)


def webdataset_sample_key(id_: str | int, k: int | None) -> str:
    """The sample key of one image inside a WebDataset tar: members are "{key}.{ext}" and
    "{key}.json". k as layout.image_index_in_key gives it (None for a row's only image).

    WebDataset readers split a member name into key and extension at the *first* dot of its
    base name, so the key must contain none: "." is escaped as "~2E", the same escape
    `safe_key_component` gives a leading dot. Every byte outside [A-Za-z0-9-] is then escaped,
    so distinct ids still give distinct keys; "_" is escaped too, so the "_{k}" suffix cannot
    make one row's key equal another's. A shortened (hashed) component stays unique by its hash.
    """
    return safe_key_component(id_).replace(".", "~2E") + k_suffix(k)


def sample_metadata(task: ImageTask, width: int, height: int) -> bytes:
    """The `{key}.json` member: compact UTF-8 JSON, keys in a fixed order.

    `seed` is the seed this image was generated from (the task's: the row's seed for k = 0,
    generate.image_seed(row seed, k) for the others), so one sample alone says how to remake it;
    `width`/`height` are the stored image's pixels; `extra` is the row's pass-through columns as
    a JSON object (null when there are none)."""
    doc = {**task.fields(width, height), "extra": None if task.extra is None else json.loads(task.extra)}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    # Fixed header fields: the tar's bytes depend on the images and their metadata only.
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


def _sample_key(id_: str, k: int, num_images: int) -> str:
    return webdataset_sample_key(id_, image_index_in_key(k, num_images))


class WebDatasetShardWriter(SpooledShardWriter):
    content_type = "application/x-tar"

    def __init__(self, store: ObjectStore, shard: int, config: WriterSettings, attempt: str) -> None:
        super().__init__(store, shard, config, webdataset_key(shard, attempt))
        # PAX: member names longer than ustar's 100 bytes (long ids) are stored whole.
        self._tar = tarfile.open(fileobj=self._spool, mode="w", format=tarfile.PAX_FORMAT)
        self._members = 0

    def _entry(self, task: ImageTask) -> tuple[str, str]:
        key = _sample_key(task.id, task.k, task.num_images)
        return key, f"member {key}.{self._ext}"

    def _append(self, task: ImageTask, name: str, data: bytes, digest: str, width: int, height: int) -> None:
        meta = sample_metadata(task, width, height)
        # Image first, then its metadata: a sample's members must be adjacent in the tar.
        self._tar.addfile(_member(f"{name}.{self._ext}", len(data)), io.BytesIO(data))
        self._tar.addfile(_member(f"{name}.json", len(meta)), io.BytesIO(meta))
        self._members += 2

    def _close(self) -> bool:
        if self._members == 0:  # every row failed: no tar
            return False
        # Writes the end-of-archive blocks. Not on abort: the spool is discarded then.
        self._tar.close()
        return True


class WebDatasetShardReader:
    """Reads a tar whole: a row's image is the member "{sample key}.{ext}"; every other member is
    accounted for. A "{key}.json" member of no named sample says which row the tar holds that the
    manifest does not name; a member twice, a member of no sample, a named sample without its
    metadata (or metadata of another row), a non-file member or bytes after the end of the
    archive are findings: WebDataset readers iterate every member."""

    def read(self, store: ObjectStore, key: str, rows: Sequence[ManifestImage]) -> StoredImages:
        uri = store.uri(key)
        blob = store.get(key)  # ObjectNotFound when absent
        named = {_sample_key(r.id, r.k, r.num_images): r for r in rows}
        found: dict[tuple[str, int], bytes] = {}
        findings: list[str] = []
        unnamed: list[tuple[str, int]] = []
        try:
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
                members = _index(tar, uri)
                end = tar.offset  # where the end-of-archive blocks start
                for name, n in Counter(m.name for m in members).items():
                    if n > 1:
                        findings.append(f"{uri}: member {name} appears {n} times (readers see each)")
                findings.extend(
                    f"{uri}: member {m.name} is not a regular file" for m in members if not m.isfile()
                )
                files = {m.name: m for m in members if m.isfile()}
                by_sample: dict[str, list[str]] = {}
                for name in files:
                    by_sample.setdefault(name.partition(".")[0], []).append(name)
                for sample, names in by_sample.items():
                    row = named.get(sample)
                    meta_name = f"{sample}.json"
                    if row is None:
                        if meta_name in files:
                            unnamed.append(
                                _row_of_metadata(_member_bytes(tar, files[meta_name], uri), uri, meta_name)
                            )
                        else:
                            findings.extend(f"{uri}: member {n} belongs to no manifest row" for n in names)
                        continue
                    image_name = f"{sample}.{IMAGE_EXTENSIONS.get(row.image_format, row.image_format)}"
                    findings.extend(
                        f"{uri}: member {n} is not one of sample {sample}'s members"
                        for n in names
                        if n not in (image_name, meta_name)
                    )
                    if image_name in files:
                        found[(row.id, row.k)] = _member_bytes(tar, files[image_name], uri)
                    if meta_name not in files:
                        findings.append(f"{uri}: sample {sample} has no {meta_name} member")
                        continue
                    try:
                        said = _row_of_metadata(_member_bytes(tar, files[meta_name], uri), uri, meta_name)
                    except StoredImageError as e:  # the image is still readable: a finding only
                        findings.append(str(e))
                        continue
                    if said != (row.id, row.k):
                        findings.append(
                            f"{uri}: member {meta_name} is the metadata of another row than {row.label}"
                        )
        except (tarfile.TarError, OSError) as e:
            raise StoredImageError(f"{uri}: cannot be read as a tar ({e})") from e
        # Bytes past the end-of-archive blocks are invisible to this reader but not to one that
        # skips zero blocks (tar --ignore-zeros, tarfile's ignore_zeros).
        trailing = blob[end:].rstrip(b"\0")
        if trailing:
            findings.append(f"{uri}: {len(trailing)} bytes of data after the end of the archive")
        return StoredImages(uri, found, tuple(unnamed), findings=tuple(findings))


def _index(tar: tarfile.TarFile, uri: str) -> list[tarfile.TarInfo]:
    """Every member header, in order. Listing reads every header; where it fails, the error
    names the last member listed (the one cut short, when the data ends early)."""
    members: list[tarfile.TarInfo] = []
    try:
        # Iterating reads the headers one by one (as getmembers does), so the ones read before a
        # failure are at hand.
        members.extend(tar)
        return members
    except tarfile.ReadError as e:
        if not members:
            raise
        last = members[-1].name
        where = f"member {last} is cut short" if "end of data" in str(e) else f"after member {last}"
        raise StoredImageError(f"{uri}: cannot be read as a tar ({e}; {where})") from e


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, uri: str) -> bytes:
    try:
        f = tar.extractfile(member)
        data = f.read() if f is not None else b""
    except (tarfile.TarError, OSError) as e:
        raise StoredImageError(f"{uri}: member {member.name} cannot be read ({e})") from e
    if len(data) != member.size:
        raise StoredImageError(
            f"{uri}: member {member.name} is cut short ({len(data)} of {member.size} bytes)"
        )
    return data


def _row_of_metadata(data: bytes, uri: str, name: str) -> tuple[str, int]:
    try:
        meta = json.loads(data)
        return meta["id"], meta["k"]
    except (ValueError, KeyError, TypeError) as e:
        raise StoredImageError(
            f"{uri}: member {name} is not a sample's metadata ({type(e).__name__}: {e})"
        ) from e


FORMAT = OutputFormat(
    "webdataset",
    "one tar per shard ({key}.{ext} + {key}.json)",
    OBJECTS,
    WebDatasetShardWriter,
    WebDatasetShardReader(),
)
