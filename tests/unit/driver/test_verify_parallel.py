"""`ditfleet verify` with 1 thread and with many gives the same report, on a clean output and on
hostile ones (a changed, a missing and a stray object, a row in two manifests, a uri outside the
output, a stray manifest, orphans of a losing run). Outputs written by hand in a local store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ditfleet.driver.output.verify import verify_output
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import job_key, new_attempt_token
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store

SHARDS, IMAGES = 12, 20


def _build(root: Path):
    store = open_store(str(root))
    keys = {}
    for shard in range(SHARDS):
        token, loser = new_attempt_token(0), new_attempt_token(1)
        writer = ManifestWriter(shard, expected_rows=IMAGES)
        for i in range(IMAGES):
            row_id = f"r{shard:03d}-{i:03d}"
            key = image_key(shard, token, row_id, None, "png")
            keys[(shard, i)] = key
            stored = put_image(store, key, os.urandom(64 + i))
            if i % 5 == 0:  # a losing run's objects
                store.put(image_key(shard, loser, row_id, None, "png"), os.urandom(32))
            if shard == 3 and i == 7:  # the id of a row of shard 2: a row in two manifests
                row_id = "r002-007"
            if shard == 4 and i == 1:  # a uri outside the output
                stored = ("/etc/passwd", stored[1], stored[2])
            writer.add(manifest_row(row_id, shard, stored, prompt="p", seed=i, model_id="m", worker="w"))
        writer.commit(store)
    plan = {"shards": SHARDS, "rows": SHARDS * IMAGES, "images": SHARDS * IMAGES}
    store.put(job_key(), json.dumps({"fingerprint": "test", "plan": plan}).encode())
    return store, keys


def _harm(root: Path, store, keys, case: str) -> None:
    if case == "changed object":
        path = root / keys[(1, 3)]
        data = path.read_bytes()
        path.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    elif case == "missing object":
        store.delete(keys[(5, 9)])
    elif case == "stray object":
        store.put("images/99999/stray.png", b"x")
    elif case == "stray manifest":
        store.put("manifests/notes.txt", b"x")


@pytest.mark.parametrize(
    "case", ["clean", "changed object", "missing object", "stray object", "stray manifest"]
)
def test_parallel_verify_equals_serial_verify(tmp_path: Path, case: str):
    store, keys = _build(tmp_path)
    _harm(tmp_path, store, keys, case)
    serial = verify_output(store, partial=True, workers=1).to_dict()
    for workers in (2, 8, 32):
        assert verify_output(store, partial=True, workers=workers).to_dict() == serial, workers
    problems = "\n".join(serial["problems"]) if "problems" in serial else str(serial)
    # The hostile rows built in are found by both; each case's harm too.
    assert "r002-007" in problems and "/etc/passwd" in problems
    expected = {
        "changed object": keys[(1, 3)],
        "missing object": keys[(5, 9)],
        "stray object": "images/99999/stray.png",
        "stray manifest": "manifests/notes.txt",
    }.get(case)
    if expected is not None:
        assert expected in problems


@pytest.mark.slow
def test_parallel_clean_deletes_what_serial_would(tmp_path: Path):
    a, _ = _build(tmp_path / "a")
    b, _ = _build(tmp_path / "b")
    ra = verify_output(a, partial=True, clean=True, workers=1)
    rb = verify_output(b, partial=True, clean=True, workers=8)
    # Shard 4's manifest names a uri outside the output: its objects are kept, by both.
    assert ra.cleaned == rb.cleaned == (SHARDS - 1) * (IMAGES // 5)
    strip = lambda keys: sorted(k.split("/", 2)[1] for k in keys)  # noqa: E731 - tokens differ per build
    assert strip(ra.orphans) == strip(rb.orphans)
    with pytest.raises(ValueError, match="at least one worker"):
        verify_output(a, workers=0)
