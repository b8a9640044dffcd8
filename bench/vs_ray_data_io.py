"""Inputs and outputs of bench/vs_ray_data.py: the model, the prompts, the S3 server, and
counting what each path stored (per id: image objects, metadata rows, rewrites)."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ditfleet.workers.storage.parquet_bytes import read_parquet

BENCH_BUCKET = "bench"
# A random model gets the bundled tiny model's proportions (recipes/tiny/train_dit.py), so that
# the numbers carry over to it; the VAE and text encoder are the test fixtures' (same as bundled).
RANDOM_TRANSFORMER = dict(
    num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12)
)
_COLOURS = ("red", "green", "blue", "yellow", "white", "black")
_SHAPES = ("circle", "square", "triangle")
_PLACES = ("at the centre", "at the top left", "at the bottom right", "on the left", "on the right")


def prepare_model(arg: str, tmp: Path) -> tuple[Path, str]:
    """(diffusers-layout folder with a tiny text encoder, a name for the report)."""
    from ditfleet.model.qwen_image.loader import TINY_MODEL_DIR

    if arg == "auto" and all((TINY_MODEL_DIR / c).is_dir() for c in ("transformer", "vae", "text_encoder")):
        return TINY_MODEL_DIR, "bundled tiny"
    if arg in ("auto", "random"):
        from ditfleet.testing.models import add_tiny_text_encoder, make_diffusers_model_dir

        root = tmp / "model"
        root.mkdir()
        make_diffusers_model_dir(root, transformer_overrides=RANDOM_TRANSFORMER)
        add_tiny_text_encoder(root)
        return root, "random tiny (4 layers x 128, bundled proportions)"
    root = Path(arg).resolve()
    if not (root / "text_encoder").is_dir():
        raise SystemExit(f"{root}: no text_encoder/; the baseline needs the model's tiny text encoder")
    return root, str(root)


def prompt_text(i: int) -> str:
    """Row i's caption, in the tiny text encoder's vocabulary (9 to 12 words)."""
    return (
        f"a {('small', 'large')[i % 2]} {_COLOURS[i % 6]} {_SHAPES[i % 3]} {_PLACES[i % 5]} "
        f"on a {_COLOURS[(i + 3) % 6]} background"
    )


def write_prompts(path: Path, n: int, buckets: list[str]) -> None:
    """n rows with id, prompt, seed, width, height; sizes cycle through `buckets`."""
    sizes = [tuple(int(v) for v in b.split("x")) for b in buckets]
    rows = range(n)
    table = pa.table(
        {
            "id": [f"r{i:05d}" for i in rows],
            "prompt": [prompt_text(i) for i in rows],
            "seed": pa.array([1000 + 7 * i for i in rows], pa.int64()),
            "width": pa.array([sizes[i % len(sizes)][0] for i in rows], pa.int32()),
            "height": pa.array([sizes[i % len(sizes)][1] for i in rows], pa.int32()),
        }
    )
    pq.write_table(table, path)


def start_s3(tmp: Path) -> tuple[subprocess.Popen, str, Any]:
    """A moto server in its own process (as a real endpoint would be), a versioned bucket
    (every PUT is kept, so rewrites can be counted), and a client for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp / "moto.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the moto S3 server did not start; see {tmp / 'moto.log'}")
        time.sleep(0.1)
    from ditfleet.workers.storage import S3Config
    from ditfleet.workers.storage.s3 import make_s3_client

    endpoint = f"http://127.0.0.1:{port}"
    client = make_s3_client(S3Config(endpoint_url=endpoint, region="us-east-1", addressing_style="path"))
    client.create_bucket(Bucket=BENCH_BUCKET)
    client.put_bucket_versioning(Bucket=BENCH_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    return server, endpoint, client


def stop_s3(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)


def list_keys(client: Any, prefix: str) -> dict[str, str]:
    """key -> ETag of the current objects under prefix."""
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BENCH_BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj["ETag"]
    return out


def rewrites(client: Any, prefix: str, suffix: str) -> dict[str, int]:
    """Objects under prefix written more than once (the bucket keeps every version):
    `rewritten` extra writes in all, `rewritten_different` of them with other bytes (ETag)."""
    etags: dict[str, list[str]] = {}
    for page in client.get_paginator("list_object_versions").paginate(Bucket=BENCH_BUCKET, Prefix=prefix):
        for v in page.get("Versions", []):
            if v["Key"].endswith(suffix):
                etags.setdefault(v["Key"], []).append(v["ETag"])
    return {
        "rewritten": sum(len(e) - 1 for e in etags.values()),
        "rewritten_different": sum(len(set(e)) - 1 for e in etags.values()),
    }


def _get(client: Any, key: str, version: str | None = None) -> bytes:
    kwargs = {"VersionId": version} if version else {}
    return client.get_object(Bucket=BENCH_BUCKET, Key=key, **kwargs)["Body"].read()


def ditfleet_stored_counter(client: Any, prefix: str, fmt: str) -> Callable[[], int]:
    """Images visible to a reader: PNG objects under {prefix}/images/ ("files"), or rows of the
    data files under {prefix}/data/ ("parquet")."""
    if fmt == "parquet":
        return parquet_rows_counter(client, f"{prefix}/data/")
    return lambda: sum(1 for k in list_keys(client, f"{prefix}/images/") if k.endswith(".png"))


def parquet_rows_counter(client: Any, prefix: str) -> Callable[[], int]:
    """Rows of the Parquet files under prefix (each new or rewritten file is read once)."""
    rows: dict[str, tuple[str, int]] = {}

    def count() -> int:
        for key, etag in list_keys(client, prefix).items():
            if key.endswith(".parquet") and rows.get(key, ("", 0))[0] != etag:
                rows[key] = (etag, pq.read_metadata(pa.BufferReader(_get(client, key))).num_rows)
        return sum(n for _, n in rows.values())

    return count


def _per_id(ids: list[str], n: int) -> dict[str, int]:
    per_id = Counter(ids)
    expected = {f"r{i:05d}" for i in range(n)}
    return {
        "images_stored": len(set(per_id) & expected),
        "rows_lost": len(expected - set(per_id)),
        "rows_duplicated": sum(1 for c in per_id.values() if c > 1),
    }


def ditfleet_outputs(client: Any, prefix: str, n: int, fmt: str) -> dict[str, Any]:
    """Per id: stored images and manifest rows; rewrites of stored objects; stage timings."""
    tables = [read_parquet(_get(client, k)) for k in list_keys(client, f"{prefix}/manifests/")]
    manifest = pa.concat_tables(tables) if tables else None
    rows = manifest.to_pylist() if manifest is not None else []
    if fmt == "parquet":
        data = [read_parquet(_get(client, k)) for k in list_keys(client, f"{prefix}/data/")]
        stored = pa.concat_tables(data).select(["id", "image"]).to_pylist() if data else []
        images = {r["id"]: r["image"]["bytes"] for r in stored}
        image_ids = [r["id"] for r in stored]
        rewritten = rewrites(client, f"{prefix}/data/", ".parquet")
    else:
        keys = [k for k in list_keys(client, f"{prefix}/images/") if k.endswith(".png")]
        images = {r["id"]: _get(client, k) for k, r in _by_key(prefix, keys, rows).items()}
        image_ids = [k.rsplit("/", 1)[1].removesuffix(".png") for k in keys]
        rewritten = rewrites(client, f"{prefix}/images/", ".png")
    objects = _per_id(image_ids, n)
    meta = _per_id([r["id"] for r in rows], n)
    success = list_keys(client, f"{prefix}/_SUCCESS")
    summary = json.loads(_get(client, f"{prefix}/_SUCCESS")) if success else {}
    ok = [r for r in rows if r["status"] == "ok"]
    return {
        "images_stored": objects["images_stored"],
        "rows_lost": max(objects["rows_lost"], meta["rows_lost"]),
        "rows_duplicated": max(objects["rows_duplicated"], meta["rows_duplicated"]),
        "metadata_rows": len(rows),
        "rows_failed": len(rows) - len(ok),
        "objects_rewritten": rewritten["rewritten"],
        "objects_rewritten_different": rewritten["rewritten_different"],
        "shards_rerun": sum(1 for s in {(r["shard"], r["attempt"]) for r in rows} if s[1] > 0),
        "actor_deaths": summary.get("dispatch", {}).get("actor_deaths"),
        "dispatch": summary.get("dispatch", {}),
        "actor_wall_ms_per_image": _mean_ms(ok, ("generate_s", "encode_s", "upload_s")),
        "images": images,
    }


def _by_key(prefix: str, keys: list[str], rows: list[dict]) -> dict[str, dict]:
    by_uri = {r["uri"].split(f"/{prefix}/", 1)[-1]: r for r in rows if r.get("uri")}
    return {k: by_uri[k.removeprefix(f"{prefix}/")] for k in keys if k.removeprefix(f"{prefix}/") in by_uri}


def _mean_ms(rows: list[dict], fields: tuple[str, ...]) -> dict[str, float]:
    return {
        f.removesuffix("_s"): round(1000 * sum(r[f] or 0 for r in rows) / max(len(rows), 1), 1)
        for f in fields
    }


def baseline_outputs(client: Any, prefix: str, n: int, udf_log_dir: Path) -> dict[str, Any]:
    """Per id: rows in the Parquet files; rewritten files; the UDF's own log of started batches."""
    keys = [k for k in list_keys(client, f"{prefix}/") if k.endswith(".parquet")]
    table = pa.concat_tables([read_parquet(_get(client, k)) for k in keys]) if keys else None
    rows = table.select(["id", "image"]).to_pylist() if table is not None else []
    counts = _per_id([r["id"] for r in rows], n)
    rewritten = rewrites(client, f"{prefix}/", ".parquet")
    events = [
        json.loads(line) for f in sorted(udf_log_dir.glob("*.jsonl")) for line in f.read_text().splitlines()
    ]
    started = [i for e in events if e["event"] == "start" for i in e["ids"]]
    done = [e for e in events if e["event"] == "end"]
    per_image = {
        "generate": round(1000 * sum(e["generate_s"] for e in done) / max(len(started), 1), 1),
        "encode": round(1000 * sum(e["encode_s"] for e in done) / max(len(started), 1), 1),
    }
    return {
        **counts,
        "metadata_rows": len(rows),
        "rows_failed": 0,
        "objects_rewritten": rewritten["rewritten"],
        "objects_rewritten_different": rewritten["rewritten_different"],
        "rows_generated": len(started),  # every row a UDF call started, finished or not
        "rows_rerun": len(started) - len(set(started)),
        "actor_processes": len({e["pid"] for e in events}),
        "actor_wall_ms_per_image": per_image,
        "images": {r["id"]: r["image"] for r in rows},
    }


def compare_images(ours: dict[str, bytes], theirs: dict[str, bytes]) -> dict[str, Any]:
    """Decode both outputs' PNGs per id: max |pixel difference| (0..255) and how many differ."""
    import numpy as np
    from PIL import Image

    common = sorted(set(ours) & set(theirs))
    diffs, mismatched = [], []
    for i in common:
        a = np.asarray(Image.open(io.BytesIO(ours[i])).convert("RGB"), dtype=np.int16)
        b = np.asarray(Image.open(io.BytesIO(theirs[i])).convert("RGB"), dtype=np.int16)
        if a.shape != b.shape:
            mismatched.append(f"{i}: {a.shape} vs {b.shape}")
            continue
        diffs.append(int(np.abs(a - b).max()))
    return {
        "compared": len(common),
        "max_abs_diff": max(diffs, default=None),
        "images_differing": sum(1 for d in diffs if d > 0),
        "shape_mismatches": mismatched,
    }
