"""Every per-image record is found by the image's identity, (id, k), in every output format.

A "parquet" or "webdataset" shard's rows all name one uri (the shard's data file or tar), so a
score looked up by uri gives each row of a shard the same score: `preview --sort` showed images
under other images' scores, the report's histograms and gate strip drew one value per shard, and
the documented join of a `ditfleet score` table "on uri" multiplied the rows. Here each reader
(preview, report, the DuckDB and pyarrow joins docs/quality.md shows) runs on a real output of
each format, made by the bundled tiny model on the real worker (no Ray): 8 images in 2 shards,
`tiny` scored on the actor under a gate (the manifests' score_tiny column) and `sharpness` scored
afterwards by `ditfleet score` (side tables). The truth is each image's score recomputed from its
own stored pixels.

And a redo leaves `ditfleet score`'s tables behind: `status`, `preview`, `report` and the redo
itself name the shards without a table of their current generation, until `ditfleet score`
makes it (docs/quality.md).
"""

from __future__ import annotations

import dataclasses
import io
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from PIL import Image

from ditfleet.driver.output.claim import claim_output
from ditfleet.driver.output.status import output_status
from ditfleet.driver.plan import PlanConfig
from ditfleet.driver.run_job import DriverConfig, plan_input
from ditfleet.jobs.cli import main
from ditfleet.jobs.preview import collect_sorted
from ditfleet.jobs.report import load_report_data
from ditfleet.model.loading.folder import TINY_MODEL_DIR
from ditfleet.model.quality import scorer
from ditfleet.workers.contract import GateConfig
from ditfleet.workers.output.formats import ok_images, read_images
from ditfleet.workers.output.manifest import current_manifest_keys
from ditfleet.workers.storage import open_store
from ditfleet.workers.storage.parquet_bytes import read_parquet
from ditfleet.workers.weights.digest import local_identity
from tests.support.paths import REPO
from tests.support.worker_fixtures import finish_like_driver, row_config, worker_config, write_prompts

pytestmark = pytest.mark.slow

ROWS, SHARD_SIZE = 8, 4
FORMATS = ("files", "parquet", "webdataset")
GATE = GateConfig(scorer="tiny", min=0.5, max_tries=1)  # judged, never retried: one try an image


@dataclass
class Made:
    root: Path
    plan: object
    config: object


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Made]:
    """One finished output per format, its `sharpness` side tables made by `ditfleet score`."""
    from ditfleet.workers.actor import GenerationWorker

    base = tmp_path_factory.mktemp("scores-by-image")
    prompts = write_prompts(base / "prompts.parquet", ROWS)
    identity = local_identity(TINY_MODEL_DIR)
    outputs, worker = {}, None
    for fmt in FORMATS:
        root = base / fmt
        store = open_store(str(root))
        plan = plan_input(
            DriverConfig(
                input_uri=str(prompts),
                output_uri=str(root),
                plan=PlanConfig(rows=row_config(), shard_size=SHARD_SIZE),
            )
        )
        claim_output(store, plan, {"quality": {"gate": dataclasses.asdict(GATE)}}, identity)
        config = dataclasses.replace(
            worker_config(TINY_MODEL_DIR, str(root), output_format=fmt),
            model_identity=identity.to_dict(),
            gate=GATE,
        )
        if worker is None:
            worker = GenerationWorker(config)
        else:  # one model load for the three outputs: only where and how it stores differ
            worker.config, worker.store = config, store
        for shard in plan.shards:
            worker.run_shard(shard, 0)
        finish_like_driver(store, plan)
        assert main(["score", str(root), "--scorer", "sharpness"]) == 0
        outputs[fmt] = Made(root, plan, config)
    return outputs


def truth(store, name: str) -> dict[tuple[str, int], float | None]:
    """(id, k) -> `name`'s score of the image stored for that row, from its own pixels."""
    judge, found = scorer(name), {}
    for key in current_manifest_keys(store).values():
        table = read_parquet(
            store.get(key), ["id", "k", "status", "uri", "format", "sha256", "bytes", "prompt"]
        )
        prompts = {(r["id"], r["k"]): r["prompt"] for r in table.to_pylist()}
        for row, blob in read_images(store, ok_images(table)):
            [value] = judge.score(_pixels(Image.open(io.BytesIO(blob))), [prompts[(row.id, row.k)]])
            found[(row.id, row.k)] = None if np.isnan(value) else value
    return found


def _pixels(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)[None]  # (1, 3, H, W) uint8


@pytest.mark.parametrize("fmt", FORMATS)
def test_preview_labels_each_image_with_its_own_score(made, fmt, tmp_path, capsys):
    store = open_store(str(made[fmt].root))
    for name in ("tiny", "sharpness"):  # the manifests' column; `ditfleet score`'s side tables
        expected = truth(store, name)
        assert len(set(expected.values())) > 1, expected  # scores that differ within a shard
        shown = collect_sorted(store, ROWS, name)
        assert {(p.id, p.k): p.score for p in shown} == {i: v for i, v in expected.items() if v is not None}
        for p in shown:  # the label is the score of the image it is printed under
            assert scorer(name).score(_pixels(p.image), [p.prompt]) == [pytest.approx(p.score)], (p.id, name)
        assert [p.score for p in shown] == sorted(p.score for p in shown)
    sheet = tmp_path / "sheet.png"
    assert main(["preview", str(made[fmt].root), "--out", str(sheet), "--sort", "sharpness"]) == 0
    assert f"{ROWS} images" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", FORMATS)
def test_report_histograms_and_gate_strip_hold_each_images_score(made, fmt):
    store = open_store(str(made[fmt].root))
    data = load_report_data(store, samples=0)
    sections = {s.scorer: s for s in data.scores}
    assert set(sections) == {"tiny", "sharpness"}
    for name, section in sections.items():
        expected = [v for v in truth(store, name).values() if v is not None]
        assert sorted(section.values) == pytest.approx(sorted(expected)), name
        assert section.unscored == ROWS - len(expected) and section.behind is None
    tiny = sections["tiny"]
    failed = sorted(v for v in truth(store, "tiny").values() if v is not None and v < GATE.min)
    assert failed, "the gate failed no image: nothing for the strip to show under the threshold"
    shown = [float(t.caption.split(":")[0].removeprefix("score ")) for t in tiny.below]
    assert shown == pytest.approx(failed[-len(tiny.below) :]) and len(tiny.below) == min(4, len(failed))


def _doc_blocks(language: str) -> list[str]:
    text = (REPO / "docs" / "quality.md").read_text()
    section = text[text.index("## Filtering rows as a reader") : text.index("## Provenance in every image")]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_documented_joins_give_each_image_once_with_its_score(made, fmt, tmp_path, monkeypatch, capsys):
    import duckdb

    root = tmp_path / "out" / "tiny"  # where the docs' queries look
    shutil.copytree(made[fmt].root, root)
    (root / "scores" / "tiny").mkdir(parents=True)  # the docs join the tiny table: the sharpness one here
    for table in (root / "scores" / "sharpness").iterdir():
        table.rename(root / "scores" / "tiny" / table.name)
    expected = {i: v for i, v in truth(open_store(str(root)), "sharpness").items() if v is not None}
    monkeypatch.chdir(tmp_path)
    queries = [q for q in _doc_blocks("sql")[0].split(";") if q.strip().strip("-").strip()]
    join = queries[1].replace("s.score >= 0.8", "s.score >= 0")  # every sharpness score
    with duckdb.connect() as con:
        rows = con.execute(join).fetchall()
        assert len(rows) == len(expected)  # not one per pair of images of a shard
        assert {(r[0], r[1]): r[3] for r in rows} == pytest.approx(expected)
        pairs = {frozenset(p[:2]) for p in con.execute(queries[2]).fetchall()}
    manifests = ds.dataset(str(root / "manifests")).to_table(columns=["id", "phash"]).to_pylist()
    near = {
        frozenset((a["id"], b["id"]))
        for i, a in enumerate(manifests)
        for b in manifests[i + 1 :]
        if a["phash"] is not None
        and b["phash"] is not None
        and bin((a["phash"] ^ b["phash"]) & (2**64 - 1)).count("1") <= 6
    }
    assert pairs == near  # within a shard too, where every row has the same uri
    # The pyarrow join as the docs write it (its keys), on every ok row.
    [python] = _doc_blocks("python")
    keys = eval(re.search(r"kept\.join\(tiny, (\[.*?\])\)", python).group(1))  # noqa: S307 - the docs' literal
    kept = ds.dataset(str(root / "manifests")).to_table(columns=["id", "k", "uri", "status"])
    scores = ds.dataset(str(root / "scores" / "tiny")).to_table(columns=["id", "k", "uri", "score"])
    joined = kept.join(scores, keys).to_pylist()
    assert {(r["id"], r["k"]): r["score"] for r in joined} == pytest.approx(expected)
    assert len(joined) == len(expected)
    # The command's own hint names the same keys.
    assert main(["score", str(root), "--scorer", "tiny"]) == 0
    assert "join on id, k and uri with the manifests" in capsys.readouterr().out


def test_a_redo_leaves_score_tables_behind_and_every_reader_says_so(made, tmp_path, capsys):
    from ditfleet.workers.actor import GenerationWorker

    root = tmp_path / "out"
    shutil.copytree(made["parquet"].root, root)
    store = open_store(str(root))
    plan = made["parquet"].plan
    worker = GenerationWorker(dataclasses.replace(made["parquet"].config, output_uri=str(root)))
    redo = dataclasses.replace(plan.shards[1], generation=1)  # `--redo-shards 1`
    assert worker.run_shard(redo, 0).status == "committed"
    log = io.StringIO()
    finish_like_driver(store, dataclasses.replace(plan, shards=[plan.shards[0], redo]), out=log)
    behind = "scores/sharpness/ does not cover 1 shard(s)"
    why = "shards redone since they were scored: 1 (table of generation 0, now 1)"
    command = f"Run `ditfleet score {root} --scorer sharpness`"
    assert behind in log.getvalue() and why in log.getvalue() and command in log.getvalue(), log.getvalue()

    status = output_status(store)
    assert status.to_dict()["score_tables"] == {
        "sharpness": {"scored": 1, "manifests": 2, "stale": {"1": [0, 1]}, "unscored": []}
    }
    assert main(["status", str(root)]) == 0
    assert f"scores/sharpness/: 1 of 2 shard manifests scored; STALE: {behind}" in capsys.readouterr().out

    # preview: shard 0's images alone, and a note on stderr saying why
    assert main(["preview", str(root), "--out", str(tmp_path / "sheet.png"), "--sort", "sharpness"]) == 0
    said = capsys.readouterr()
    assert f"{SHARD_SIZE} images" in said.out and why in said.err and command in said.err
    # report: the section's note, on the page and on stderr; the manifests' own tiny column is current
    html = tmp_path / "report.html"
    assert main(["report", str(root), "--html", str(html), "--max", "0"]) == 0
    assert why in capsys.readouterr().err
    page = html.read_text()
    assert 'id="stale-sharpness"' in page and "stale-tiny" not in page
    assert f"{SHARD_SIZE} images scored, {ROWS - SHARD_SIZE} ok images without a score" in page
    # the documented join: the superseded generation's scores never attach to the redo's images
    keys = ["id", "k", "uri"]
    rows = ds.dataset(str(root / "manifests")).to_table(columns=keys)
    joined = rows.join(ds.dataset(str(root / "scores" / "sharpness")).to_table(), keys).to_pylist()
    assert len(joined) == ROWS  # pyarrow's join is a left outer one: the redo's rows with a null
    assert sorted(r["id"] for r in joined if r["score"] is not None) == [
        f"p{i:05d}" for i in range(SHARD_SIZE)
    ]

    # `ditfleet score` makes the redo's table; every reader is current again
    assert main(["score", str(root), "--scorer", "sharpness"]) == 0
    assert "deleted 1 table(s) of superseded generations" in capsys.readouterr().out
    assert main(["status", str(root)]) == 0
    assert "scores/sharpness/: 2 of 2 shard manifests scored (current)" in capsys.readouterr().out
    assert {(p.id, p.k): p.score for p in collect_sorted(store, ROWS, "sharpness")} == pytest.approx(
        {i: v for i, v in truth(store, "sharpness").items() if v is not None}
    )
    assert load_report_data(store, samples=0).scores[1].behind is None
