"""Outputs written by hand and the manifest rows that name them, for tests and benchmarks that need
a finished-looking output without generating images. Torch-free."""

from __future__ import annotations

import hashlib
from typing import Any

from ditfleet.workers.output.manifest import ManifestRow
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
