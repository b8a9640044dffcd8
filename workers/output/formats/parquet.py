"""Output format "parquet": one data file per run of a shard, images embedded as the Hugging Face
datasets Image struct (load_dataset yields PIL images without a cast), at
data/shard-{shard:05d}-{attempt}.parquet (`data_key`); its writer, its reader and its registry row."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ditfleet.workers.output.formats.base import (
    ImageTask,
    ManifestImage,
    OutputFormat,
    StoredImageError,
    StoredImages,
    WriterSettings,
)
from ditfleet.workers.output.formats.spool import SpooledShardWriter
from ditfleet.workers.output.layout import ShardObjects, image_file_name, image_index_in_key
from ditfleet.workers.storage.base import ObjectStore
from ditfleet.workers.storage.parquet_bytes import read_parquet

# One data file per run of a shard.
OBJECTS = ShardObjects("data/", ".parquet")


def data_key(shard: int, attempt: str) -> str:
    """Key of a shard's data file, written by the run `attempt` (its token)."""
    return OBJECTS.key(shard, attempt)


IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])

# All fields nullable: `datasets` only applies its features to fields equal to its own
# (always nullable) ones, so a non-nullable "image" would load as a plain dict.
_FIELDS = [
    pa.field("image", IMAGE_STRUCT),
    pa.field("id", pa.string()),
    pa.field("k", pa.int32()),
    pa.field("prompt", pa.string()),
    pa.field("negative_prompt", pa.string()),
    pa.field("seed", pa.int64()),
    pa.field("width", pa.int32()),
    pa.field("height", pa.int32()),
    pa.field("sha256", pa.string()),
    pa.field("extra", pa.string()),
]
# `datasets` reads its features from this key, so load_dataset yields PIL images for
# "image" without a cast_column.
_FEATURES = {
    f.name: {"_type": "Image"} if f.name == "image" else {"dtype": str(f.type), "_type": "Value"}
    for f in _FIELDS
}
DATA_SCHEMA = pa.schema(_FIELDS, metadata={"huggingface": json.dumps({"info": {"features": _FEATURES}})})
_NOT_IMAGE = [f.name for f in DATA_SCHEMA if f.name != "image"]


class ParquetShardWriter(SpooledShardWriter):
    """One Parquet file per run of a shard at data_key(shard, attempt), rows in the order added.

    Row groups are streamed into the spool (spool.SpooledShardWriter) as they fill. Failed rows
    are not in the data file (the manifest has them).
    """

    content_type = "application/vnd.apache.parquet"

    def __init__(self, store: ObjectStore, shard: int, config: WriterSettings, attempt: str) -> None:
        super().__init__(store, shard, config, data_key(shard, attempt))
        self._writer: pq.ParquetWriter | None = None
        self._rows: list[dict[str, Any]] = []
        self._row_bytes = 0

    def _entry(self, task: ImageTask) -> tuple[str, str]:
        name = image_file_name(task.id, image_index_in_key(task.k, task.num_images), self._ext)
        return name, f"row {task.id!r} k={task.k}"

    def _append(self, task: ImageTask, name: str, data: bytes, digest: str, width: int, height: int) -> None:
        row = {"image": {"bytes": data, "path": name}, **task.fields(width, height)}
        self._rows.append({**row, "sha256": digest, "extra": task.extra})
        self._row_bytes += len(data)
        if len(self._rows) >= self.config.row_group_rows or self._row_bytes >= self.config.row_group_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(
                self._spool,
                DATA_SCHEMA,
                compression={
                    "image.bytes": "NONE",
                    **{name: "ZSTD" for name in _NOT_IMAGE},
                    "image.path": "ZSTD",
                },
                # Images are already compressed; dictionaries and min/max statistics of image
                # bytes only cost time and footer size.
                use_dictionary=["id", "prompt", "negative_prompt", "image.path"],
                write_statistics=[*_NOT_IMAGE, "image.path"],
            )
        self._writer.write_table(pa.Table.from_pylist(self._rows, schema=DATA_SCHEMA))
        self._rows, self._row_bytes = [], 0

    def _close(self) -> bool:
        self._flush()
        if self._writer is None:  # every row failed: no data file
            return False
        self._writer.close()
        return True

    def abort(self) -> None:
        super().abort()
        self._rows = []


class ParquetShardReader:
    """Reads a data file whole: the image of each row from its `image` struct, found by (id, k).

    Every row is looked at, since `pyarrow.dataset` or `datasets` over data/ returns every row:
    a row the manifest does not name (also one without image bytes), an (id, k) held twice, or a
    schema other than DATA_SCHEMA is a finding."""

    def read(self, store: ObjectStore, key: str, rows: Sequence[ManifestImage]) -> StoredImages:
        uri = store.uri(key)
        blob = store.get(key)  # ObjectNotFound when absent
        try:
            table = read_parquet(blob)
            images = pc.struct_field(table.column("image"), "bytes").to_pylist()  # null where the struct is
            ids, ks = table.column("id").to_pylist(), table.column("k").to_pylist()
        except Exception as e:  # noqa: BLE001 - any damage of the file is this one finding
            raise StoredImageError(f"{uri}: cannot be read as Parquet ({type(e).__name__}: {e})") from e
        findings: list[str] = []
        if not table.schema.equals(DATA_SCHEMA, check_metadata=False):
            findings.append(f"{uri}: not the data file schema (columns {table.schema.names})")
        counts = Counter(zip(ids, ks))
        findings.extend(
            f"{uri}: row id={id_!r} k={k} is in the file {n} times (readers see each)"
            for (id_, k), n in counts.items()
            if n > 1
        )
        held = {(id_, k): data for id_, k, data in zip(ids, ks, images)}
        found = {
            (r.id, r.k): data
            for r in rows
            if (data := held.pop((r.id, r.k), None)) is not None  # no image bytes: no image found
        }
        return StoredImages(uri, found, tuple(held), findings=tuple(findings))


FORMAT = OutputFormat(
    "parquet",
    "images embedded in one Parquet file per shard (Hugging Face datasets image struct)",
    OBJECTS,
    ParquetShardWriter,
    ParquetShardReader(),
)
