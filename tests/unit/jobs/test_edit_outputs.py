"""An edit job's output, as readers and the output commands see it: real source images and an
input Parquet of `datasets` image structs, the edited images stored by the real shard writers of
every format with a real manifest commit (ditfleet.testing.outputs.write_edit_output). The
manifest names each image's sources; verify, compaction and status take the list columns;
the images' metadata names the sources; preview and the report draw each edit beside its sources
(a source that cannot be shown a labelled blank); failures count by reason."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ditfleet.driver.output.compact import check_compacted, compact_output
from ditfleet.driver.output.status import output_status
from ditfleet.driver.output.verify import verify_output
from ditfleet.jobs.cli import main
from ditfleet.jobs.preview import THUMB, collect
from ditfleet.jobs.report_images import image_cells, thumbnail
from ditfleet.jobs.source_images import SourceImage, source_reader
from ditfleet.testing.outputs import EditOutput, write_edit_output
from ditfleet.workers.output.formats import ok_images, read_images
from ditfleet.workers.output.manifest import failure_reason, read_manifests
from ditfleet.workers.output.provenance import XMP_NAMESPACE
from ditfleet.workers.storage import ObjectStore, open_store
from tests.support.paths import REPO

FORMATS = [("files", "png"), ("parquet", "jpeg"), ("webdataset", "webp")]
RDF = "http://www.w3.org/1999/02/22-rdf-syntax-ns#"
REASONS = {"source N (…) is missing": 1, "source N (…) is not an image Pillow reads": 1}


def _edit_output(root: Path, fmt: str = "files", image_format: str = "png") -> tuple[ObjectStore, EditOutput]:
    out = open_store(str(root / "out" / "edit"))
    return out, write_edit_output(out, open_store(str(root / "in")), fmt, image_format)


def _decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize(("fmt", "image_format"), FORMATS)
def test_every_format_names_each_images_sources_and_checks_clean(tmp_path, fmt, image_format):
    out, made = _edit_output(tmp_path, fmt, image_format)
    table = read_manifests(out)
    rows = {r["id"]: r for r in table.to_pylist()}
    for row_id, sources in made.sources.items():
        assert rows[row_id]["source_uris"] == [u for u, _ in sources]
        assert rows[row_id]["source_sha256"] == [h for _, h in sources]
        assert rows[row_id]["status"] == ("ok" if made.ok[row_id] else "failed")
    # An embedded source is named by its input row, with or without a struct path (a bare name).
    assert rows["e1"]["source_uris"][1] == f"{made.input_uri}#row=1&image=1"
    assert rows["e2"]["source_uris"] == [f"{made.input_uri}#row=2&image=0"]
    assert rows["e3"]["source_sha256"] == [None]
    # verify, compaction (its digest takes the list columns) and status all take the output.
    report = verify_output(out)
    assert report.exit_code == 0, report.format_text()
    compact_output(out)
    assert check_compacted(out) == []
    status = output_status(out).to_dict()
    assert status["complete"] and status["rows"]["failed"] == 2
    assert status["failures_by_error"] == REASONS
    # Each stored image's metadata names its sources (PNG: the ditfleet chunk; JPEG/WebP: XMP).
    for row, data in read_images(out, ok_images(table)):
        image = Image.open(io.BytesIO(data))
        if image_format == "png":
            named = [(s["uri"], s["sha256"]) for s in json.loads(image.text["ditfleet"])["sources"]]
        else:
            root = ET.fromstring(image.info["xmp"])  # the ordered rdf:Seq of the sources
            named = [
                (li.findtext(f"{{{XMP_NAMESPACE}}}uri"), li.findtext(f"{{{XMP_NAMESPACE}}}sha256"))
                for li in root.iter(f"{{{RDF}}}li")
                if li.find(f"{{{XMP_NAMESPACE}}}uri") is not None
            ]
        assert tuple(named) == made.sources[row.id]


def test_failures_count_by_reason_not_by_source():
    uris = ["s3://in/a/cat-0001.png"]
    assert failure_reason("source 0 (s3://in/a/cat-0001.png) is 70.2 MiB, over the limit (64)", uris) == (
        "source N (…) is N MiB, over the limit (N)"
    )
    assert failure_reason("source 1 (s3://in/b.png) is missing", ["s3://in/a.png", "s3://in/b.png"]) == (
        "source N (…) is missing"
    )
    # A text job's errors (no sources; or an error that does not name one) are their own reasons.
    text_error = "encode failed: ImageEncodeError: 3 non-finite values"
    assert failure_reason(text_error) == text_error == failure_reason(text_error, uris)
    assert failure_reason(None) == "?"


def test_preview_shows_each_edit_beside_its_sources_and_a_blank_for_one_it_cannot_read(tmp_path):
    out, _ = _edit_output(tmp_path)
    inputs = tmp_path / "in"
    shown = {p.id: p for p in collect(out, 10, source_reader(out))}
    assert sorted(shown) == ["e0", "e1", "e2"]  # the ok images; failed rows have none
    e0, e1, e2 = shown["e0"], shown["e1"], shown["e2"]
    assert np.array_equal(np.asarray(e0.sources[0].image), _decoded((inputs / "sources/s0.png").read_bytes()))
    # The edited image is the source inverted (the builder's stand-in edit): shown as stored.
    assert np.array_equal(np.asarray(e0.image), 255 - np.asarray(e0.sources[0].image))
    # An embedded source named by its input row is read from that row (row groups of 2: the second).
    assert e1.sources[1].image is not None and e1.sources[1].problem is None
    embedded = pq.read_table(inputs / "input.parquet").column("image")[1].as_py()[1]["bytes"]
    assert np.array_equal(np.asarray(e1.sources[1].image), _decoded(embedded))
    # One whose struct gave a path too (a bare file name) is read from its row all the same.
    assert e2.sources[0].image is not None and e2.sources[0].problem is None

    (inputs / "sources/s0.png").unlink()  # a source gone since: a blank, never a crash
    (inputs / "sources/s1.png").write_bytes(b"not an image any more")
    shown = {p.id: p for p in collect(out, 10, source_reader(out))}
    assert (shown["e0"].sources[0].image, shown["e0"].sources[0].problem) == (None, "missing")
    assert shown["e1"].sources[0].problem == "not an image (UnidentifiedImageError)"

    sheet_path = tmp_path / "sheet.png"
    assert main(["preview", str(out.uri()), "--out", str(sheet_path), "--columns", "1"]) == 0
    sheet = np.asarray(Image.open(sheet_path).convert("RGB"))
    # One column, three panels a cell (two sources at most, then the image): e0's blank first.
    assert sheet.shape[1] == 3 * (THUMB + 8) + 8
    assert tuple(sheet[8 + THUMB // 2, 8 + THUMB // 2]) == (0xE6, 0xE6, 0xE6)
    result = sheet[8 : 8 + THUMB, 8 + 2 * (THUMB + 8) : 8 + 3 * (THUMB + 8) - 8]
    assert tuple(result[THUMB // 2, THUMB // 2]) == tuple(np.asarray(e0.image)[16, 16])


def test_the_report_shows_sources_and_counts_failed_rows_by_reason(tmp_path):
    out, made = _edit_output(tmp_path)
    (tmp_path / "in" / "sources/s1.png").unlink()
    page = tmp_path / "report.html"
    assert main(["report", str(out.uri()), "--html", str(page)]) == 0
    text = page.read_text()
    samples = text[text.index('id="samples"') :]
    assert samples.count('class="cell edit"') == 3
    assert 'alt="source 1"' in samples and 'alt="source 2"' in samples  # e0's and e1's embedded one
    assert "source 1: missing" in samples  # e1's first, gone since
    assert "a relative name" not in samples  # e2's embedded source, drawn from its row
    errors = text[
        text.index('<table id="errors">') : text.index("</table>", text.index('<table id="errors">'))
    ]
    for reason, n in REASONS.items():
        assert f"<tr><td>{reason}</td><td>{n}</td></tr>" in errors
    # Each failed image is still listed with its whole error, the source's URI in it.
    assert made.sources["e3"][0][0] in text[text.index('<table id="failures">') :]


def test_the_documented_join_back_to_the_sources_runs_as_written(tmp_path, monkeypatch):
    out, made = _edit_output(tmp_path)
    monkeypatch.chdir(tmp_path)
    captions = [(u, f"caption of {u.rsplit('/', 1)[-1]}") for u, _ in made.sources["e1"]]
    pq.write_table(
        pa.table({"uri": [u for u, _ in captions], "caption": [c for _, c in captions]}), "sources.parquet"
    )
    text = (REPO / "docs" / "quality.md").read_text()
    [sql] = re.findall(r"```sql\n(.*?)```", text[text.index("## Edit jobs: each image's sources") :], re.S)
    rows = duckdb.sql(sql).fetchall()
    columns = duckdb.sql(sql).columns
    got = sorted(
        (r[columns.index("id")], r[columns.index("source_index")], r[columns.index("caption")]) for r in rows
    )
    assert got == [("e1", 1, captions[0][1]), ("e1", 2, captions[1][1])]


def test_a_source_over_the_cap_is_not_read_whole_and_odd_uris_are_escaped(tmp_path):
    out, made = _edit_output(tmp_path)
    size = (tmp_path / "in" / "sources/s0.png").stat().st_size
    small = dataclasses.replace(source_reader(out), max_bytes=size - 1)
    [over] = small.read([made.sources["e0"][0][0]])
    assert over.image is None and over.problem == f"over {(size - 1) / 2**20:g} MiB, not drawn"
    # A URI is text on the page, whatever it holds.
    hostile = '"><script>alert(1)</script>'
    cells = image_cells(
        [thumbnail(Image.new("RGB", (8, 8)), "r<1>", 0, "p&q", [SourceImage(hostile, None, "missing")])]
    )
    assert "<script>" not in cells and "&lt;script&gt;" in cells and "r&lt;1&gt;" in cells
