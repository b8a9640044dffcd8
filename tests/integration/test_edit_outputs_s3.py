"""An edit job's output and its sources on S3 (a real moto HTTP server): the manifest names the
sources by s3:// URI, verify and status take it, and `ditfleet preview` reads each source through
the stores (an embedded one from its row of the input Parquet on S3), a gone one a blank."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
from PIL import Image

from ditfleet.driver.output.status import output_status
from ditfleet.driver.output.verify import verify_output
from ditfleet.jobs.cli import main
from ditfleet.jobs.preview import collect
from ditfleet.jobs.source_images import source_reader
from ditfleet.testing.outputs import source_png, write_edit_output
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store


def test_an_edit_output_on_s3_previews_its_sources_from_s3(s3_server, s3_bucket, tmp_path):
    s3 = s3_server.config()
    out = open_store(f"s3://{s3_bucket}/out", s3)
    inputs = open_store(f"s3://{s3_bucket}/in", s3)
    made = write_edit_output(out, inputs, "parquet", "png")
    rows = {r["id"]: r for r in read_manifests(out).to_pylist()}
    assert rows["e0"]["source_uris"] == [f"s3://{s3_bucket}/in/sources/s0.png"]
    assert rows["e1"]["source_uris"][1] == f"s3://{s3_bucket}/in/input.parquet#row=1&image=1"
    assert verify_output(out).exit_code == 0
    assert output_status(out).to_dict()["rows"]["failed"] == 2

    inputs.delete("sources/s1.png")  # e1's first source is gone since
    shown = {p.id: p for p in collect(out, 10, source_reader(out, s3))}
    source = np.asarray(shown["e0"].sources[0].image)
    assert np.array_equal(source, np.asarray(Image.open(io.BytesIO(source_png(0))).convert("RGB")))
    assert (shown["e1"].sources[0].image, shown["e1"].sources[0].problem) == (None, "missing")
    embedded = shown["e1"].sources[1]
    assert embedded.problem is None and embedded.uri == made.sources["e1"][1][0]
    assert np.array_equal(
        np.asarray(embedded.image), np.asarray(Image.open(io.BytesIO(source_png(2))).convert("RGB"))
    )

    # Streamed from S3 and stopped at the cap: a huge source is never read whole for a thumbnail.
    small = dataclasses.replace(source_reader(out, s3), max_bytes=100)
    assert small.read_one(made.sources["e0"][0][0]).problem == f"over {100 / 2**20:g} MiB, not drawn"

    sheet = tmp_path / "sheet.png"
    args = [
        "preview",
        out.uri(),
        "--out",
        str(sheet),
        "--endpoint-url",
        s3_server.endpoint_url,
        "--region",
        "us-east-1",
    ]
    assert main(args) == 0 and Image.open(sheet).size[0] > 0
