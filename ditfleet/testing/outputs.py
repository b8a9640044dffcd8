"""Outputs written by hand and the manifest rows that name them, for tests and benchmarks that need
a finished-looking output without generating images. Torch-free."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from ditfleet.workers.output.manifest import ManifestRow, ManifestWriter, failure_reason
from ditfleet.workers.storage import ObjectStore


def put_image(store: ObjectStore, key: str, data: bytes) -> tuple[str, str, int]:
    """Store `data` at `key`; return what a manifest row says of it: (uri, sha256, bytes)."""
    store.put(key, data)
    return store.uri(key), hashlib.sha256(data).hexdigest(), len(data)


def manifest_row(row_id: str, shard: int, stored: tuple[str, str, int] | None, **fields: Any) -> ManifestRow:
    """A manifest row for an output written by hand: "ok" naming the `stored` (uri, sha256, bytes),
    or "failed" when `stored` is None (then `error=` is required). `fields` replace the defaults
    (a 64x64 png, image 0, seed 1, 2 steps, no guidance, attempt 0) and any of the above."""
    uri, sha256, size = stored or (None, None, None)
    defaults: dict[str, Any] = dict(
        k=0, prompt=f"prompt {row_id}", seed=1, width=64, height=64, bucket="64x64", steps=2,
        true_cfg_scale=1.0, model_id="test", format="png", worker="test", attempt=0,
    )  # fmt: skip
    stored_fields = dict(status="ok" if stored else "failed", uri=uri, sha256=sha256, bytes=size)
    return ManifestRow(**{**defaults, "id": row_id, "shard": shard, **stored_fields, **fields})


# -- an edit job's output, written by hand ---------------------------------------------------------

EDIT_IMAGE_COLUMN = "image"  # the input column of edit_output's input file (input.image_column)
_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@dataclass(frozen=True)
class EditOutput:
    """What `write_edit_output` wrote: the input file's URI, and per row id its sources as the
    manifest names them ((uri, sha256 or None), column order) and whether it is ok."""

    input_uri: str
    sources: dict[str, tuple[tuple[str, str | None], ...]]
    ok: dict[str, bool]


def source_png(seed: int, size: int = 32) -> bytes:
    """A real source image: a colour field with a square of another colour (PNG bytes)."""
    rng = np.random.default_rng(seed)
    pixels = np.empty((size, size, 3), np.uint8)
    pixels[:] = rng.integers(0, 256, 3, dtype=np.uint8)
    a, b = size // 4, 3 * size // 4
    pixels[a:b, a:b] = rng.integers(0, 256, 3, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def write_edit_output(
    out: ObjectStore, inputs: ObjectStore, output_format: str = "files", image_format: str = "png"
) -> EditOutput:
    """A finished-looking edit job's output in `out`, its sources and input Parquet in `inputs`
    (local or S3), through the real shard writer of `output_format` and a real manifest commit:
    one shard of five rows, an image column of `datasets` image structs (list<struct>):

    - e0: one source by URI (a struct with only a path);
    - e1: two, a URI and one embedded without a path (named `<input>#row=1&image=1`);
    - e2: one embedded with a path (named by its row all the same, `<input>#row=2&image=0`);
    - e3: a URI whose object is gone: the row failed, that source's sha256 null;
    - e4: a URI whose object is not an image: the row failed, that source's sha256 known.

    The edited image is its first source with its colours inverted (real pixels); its metadata
    names its sources (ImageTask.sources). `_job.json` names the image column; `_SUCCESS` is there."""
    from ditfleet.workers.output.formats import ImageTask, ShardWriterConfig, make_shard_writer
    from ditfleet.workers.output.layout import job_key, new_attempt_token, success_key

    input_uri = inputs.uri("input.parquet")
    pngs = [source_png(i) for i in range(4)]
    inputs.put("sources/s0.png", pngs[0])
    inputs.put("sources/s1.png", pngs[1])
    inputs.put("sources/not-an-image.png", b"this is text, not an image")
    structs = {
        "e0": [{"bytes": None, "path": inputs.uri("sources/s0.png")}],
        "e1": [{"bytes": None, "path": inputs.uri("sources/s1.png")}, {"bytes": pngs[2], "path": None}],
        "e2": [{"bytes": pngs[3], "path": "photos/e2.png"}],
        "e3": [{"bytes": None, "path": inputs.uri("sources/gone.png")}],
        "e4": [{"bytes": None, "path": inputs.uri("sources/not-an-image.png")}],
    }
    table = pa.table(
        {"id": list(structs), "prompt": [f"make {i} blue" for i in structs],
         EDIT_IMAGE_COLUMN: pa.array(list(structs.values()), pa.list_(_STRUCT))}
    )  # fmt: skip
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=2)  # several row groups: the reader finds the row's
    inputs.put("input.parquet", buf.getvalue())

    named: dict[str, tuple[tuple[str, str | None], ...]] = {}
    first: dict[str, bytes | None] = {}
    for n, (row_id, values) in enumerate(structs.items()):
        refs = []
        for i, v in enumerate(values):
            embedded = v["bytes"] is not None  # workers.sources' naming: by its row, whatever its path
            uri = f"{input_uri}#row={n}&image={i}" if embedded else v["path"]
            data = v["bytes"] if v["bytes"] is not None else _read(inputs, v["path"])
            refs.append((uri, None if data is None else hashlib.sha256(data).hexdigest()))
            if i == 0:
                first[row_id] = data
        named[row_id] = tuple(refs)
    ok = {row_id: _decodes(first[row_id]) for row_id in structs}

    token = new_attempt_token(0)
    cfg = ShardWriterConfig(output_format=output_format, image_format=image_format, threads=2)  # type: ignore[arg-type]
    writer = make_shard_writer(out, 0, cfg, token)
    for row_id in structs:
        if ok[row_id]:
            edited = 255 - np.asarray(Image.open(io.BytesIO(first[row_id] or b"")).convert("RGB"))
            sources = tuple((u, h) for u, h in named[row_id] if h is not None)  # an ok row's: all read
            writer.add(ImageTask(id=row_id, prompt=f"make {row_id} blue", sources=sources), edited)
    stored = {r.id: r for r in writer.finish().results}
    manifest = ManifestWriter(0, expected_rows=len(structs))
    errors = {}  # the failed rows' errors, as workers.sources words them
    for row_id in structs:
        uris, digests = [u for u, _ in named[row_id]], [h for _, h in named[row_id]]
        result = stored.get(row_id)
        kept = (result.uri, result.sha256, result.bytes) if result is not None else None
        if kept is None:
            why = "is missing" if digests[0] is None else "is not an image Pillow reads"
            errors[row_id] = (f"source 0 ({uris[0]}) {why}", uris)
        manifest.add(
            manifest_row(
                row_id, 0, kept, prompt=f"make {row_id} blue", width=32, height=32, bucket="32x32",
                format=image_format, error=errors.get(row_id, (None,))[0], source_uris=uris,
                source_sha256=digests,
            )
        )  # fmt: skip
    assert manifest.commit(out)
    spec = {"name": "edit-test", "input": {"path": input_uri, "image_column": EDIT_IMAGE_COLUMN}}
    plan = {"shards": 1, "rows": len(structs), "images": len(structs)}
    out.put(job_key(), json.dumps({"fingerprint": "edit-test", "plan": plan, "spec": spec}).encode())
    out.put(success_key(), json.dumps(_edit_success(out, len(structs), list(errors.values()))).encode())
    return EditOutput(input_uri, named, ok)


def _edit_success(out: ObjectStore, rows: int, errors: list[tuple[str, list[str]]]) -> dict[str, Any]:
    """The `_SUCCESS` a driver writes for a one-shard output of `rows` rows of one image each,
    `errors` those of its failed rows (the parts status, verify and the report read)."""
    counts = {"planned": rows, "ok": rows - len(errors), "failed": len(errors)}
    reasons: dict[str, int] = {}
    for error, uris in errors:
        reasons[failure_reason(error, uris)] = reasons.get(failure_reason(error, uris), 0) + 1
    return {
        "status": "completed_with_failures" if errors else "succeeded",
        "output": out.uri(),
        "fingerprint": "edit-test",
        "shards": dict(planned=1, committed=1, committed_before=0, committed_now=1, failed=0, left=0),
        "rows": counts, "images": counts, "failures_by_error": reasons,
    }  # fmt: skip


def _read(store: ObjectStore, uri: str) -> bytes | None:
    """The bytes of `uri` in `store` (one of store's own URIs), None when it is not there."""
    key = uri.removeprefix(store.uri("")).lstrip("/")
    return store.get(key) if store.exists(key) else None


def _decodes(data: bytes | None) -> bool:
    try:
        Image.open(io.BytesIO(data or b"")).verify()
    except Exception:  # noqa: BLE001 - not an image, whatever Pillow says
        return False
    return True
