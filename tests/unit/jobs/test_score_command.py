"""`ditfleet score OUT --scorer NAME`: side tables of scores for an existing output, joined on uri,
resumable, never stale, committed files untouched; and the `tiny` scorer it uses on the embedded
default. The output is written by hand from the tiny model's own scene renderer (ground truth)."""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from ditfleet.jobs.cli import main
from ditfleet.jobs.score import score_output, scorer_source
from ditfleet.model.quality import ScorerInputs, scorer
from ditfleet.model.tiny.scenes import Scene, render
from ditfleet.testing.outputs import manifest_row, put_image
from ditfleet.workers.output.formats.files import image_key
from ditfleet.workers.output.layout import manifest_key, new_attempt_token, score_table_key
from ditfleet.workers.output.manifest import ManifestWriter
from ditfleet.workers.storage import open_store

SCENES = [
    Scene("circle", "red", "blue", "centre", "large"),
    Scene("square", "green", "white", "top left", "small"),
    Scene("triangle", "yellow", "black", "bottom", "large"),
]


def _uint8(scene: Scene, size: int = 64) -> torch.Tensor:
    return (render(scene, size, size) * 255).round().to(torch.uint8)  # (3, H, W)


def _png(pixels: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def test_tiny_scores_the_share_of_the_caption_it_reads_back():
    tiny = scorer("tiny")
    images = torch.stack([_uint8(s) for s in SCENES])
    assert tiny.score(images, [s.caption for s in SCENES]) == [1.0, 1.0, 1.0]
    wrong = Scene("circle", "green", "blue", "centre", "large").caption  # the colour alone is wrong
    assert tiny.score(images[:1], [wrong]) == [0.8]
    assert math.isnan(tiny.score(images[:1], ["a photo of a cat"])[0])  # not a caption: not judged
    alone = [tiny.score(images[i : i + 1], [SCENES[i].caption])[0] for i in range(3)]
    assert alone == tiny.score(images, [s.caption for s in SCENES])  # batch-independent
    with pytest.raises(ValueError, match="one prompt per image"):
        tiny.score(images, ["x"])


def _write_shard(store, shard: int, scenes: list[Scene], generation: int = 0, captions=None) -> list[str]:
    token = new_attempt_token(0, generation)
    writer = ManifestWriter(shard, expected_rows=len(scenes) + 1, generation=generation)
    uris = []
    for i, scene in enumerate(scenes):
        row_id = f"s{shard}-{i}"
        stored = put_image(store, image_key(shard, token, row_id, None, "png"), _png(_uint8(scene)))
        uris.append(stored[0])
        prompt = (captions or {}).get(i, scene.caption)
        writer.add(manifest_row(row_id, shard, stored, prompt=prompt, attempt=0))
    writer.add(manifest_row(f"s{shard}-failed", shard, None, error="boom"))  # no image: not scored
    assert writer.commit(store)
    return uris


def _committed(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and not str(p.relative_to(root)).startswith("scores/")
    }


def test_score_tables_join_on_uri_resume_and_never_go_stale(tmp_path, capsys):
    root = tmp_path / "out"
    store = open_store(str(root))
    _write_shard(store, 0, SCENES[:2])
    _write_shard(store, 1, SCENES[2:], captions={0: "a photo of a cat"})
    before = _committed(root)

    assert main(["score", str(root), "--scorer", "tiny"]) == 0
    assert "2/2 shard manifests scored (2 now, 3 images" in capsys.readouterr().out
    rows = ds.dataset(str(root / "manifests")).to_table(columns=["id", "uri"])
    scores = ds.dataset(str(root / "scores" / "tiny")).to_table()
    joined = rows.join(scores.select(["uri", "score"]), "uri", join_type="inner").to_pylist()
    by_id = {r["id"]: r["score"] for r in joined}
    assert by_id == {"s0-0": 1.0, "s0-1": 1.0, "s1-0": None}  # a null where it cannot judge
    assert scores.num_rows == 3  # failed rows have no image, so no score
    table = pq.read_table(root / score_table_key("tiny", manifest_key(0)))
    assert table.schema.metadata[b"ditfleet.manifest"] == manifest_key(0).encode()
    assert _committed(root) == before  # manifests and images untouched

    report = score_output(store, scorer_source(store, "tiny"))  # a rerun: nothing left to do
    assert (report.already, report.scored, report.stale_deleted) == (2, [], [])

    # A redo of shard 0 commits generation 1 with its own objects: the generation-0 table is
    # provably superseded and goes; a table of a generation newer than this run's listing stays.
    _write_shard(store, 0, SCENES[1:], generation=1)
    newer = score_table_key("tiny", manifest_key(1, 7))
    store.put(newer, b"made by a run that saw generation 7")
    report = score_output(store, scorer_source(store, "tiny"))
    assert report.stale_deleted == [score_table_key("tiny", manifest_key(0))]
    assert report.scored == [manifest_key(0, 1)] and report.images == 2
    assert store.get(newer) == b"made by a run that saw generation 7"
    store.delete(newer)
    current = ds.dataset(str(root / "scores" / "tiny")).to_table()
    assert sorted(current["uri"].to_pylist()) == sorted(
        r["uri"]
        for r in pq.read_table(root / manifest_key(0, 1)).to_pylist()
        + pq.read_table(root / manifest_key(1)).to_pylist()
        if r["uri"]
    )


def test_sharpness_tables_and_json(tmp_path, capsys):
    root = tmp_path / "out"
    _write_shard(open_store(str(root)), 0, SCENES)
    assert main(["score", str(root), "--scorer", "sharpness", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["scored"], report["images"], report["tables"]) == (1, 3, "scores/sharpness/")
    scores = pq.read_table(root / score_table_key("sharpness", manifest_key(0)))["score"].to_pylist()
    assert all(s > 0 for s in scores)


def test_bad_scorer_or_output_is_refused_with_one_line(tmp_path, capsys):
    root = tmp_path / "out"
    _write_shard(open_store(str(root)), 0, SCENES[:1])
    assert main(["score", str(root), "--scorer", "beauty"]) == 2
    err = capsys.readouterr().err
    assert "unknown image scorer 'beauty'" in err and "sharpness, tiny" in err
    assert not (root / "scores").exists()
    assert main(["score", str(tmp_path), "--scorer", "tiny"]) == 2
    assert "no manifests" in capsys.readouterr().err
    assert main(["score", str(root / "manifests" / "shard-00000.parquet"), "--scorer", "tiny"]) == 2
    assert "is a file, not an output folder" in capsys.readouterr().err


def test_the_job_asks_for_scores_by_name_and_a_wrong_name_is_refused(tmp_path):
    from ditfleet.jobs.spec import SpecError, load_spec
    from tests.support.paths import REPO

    text = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()
    job = tmp_path / "job.yaml"
    job.write_text(text + "\nquality:\n  scorers: [tiny, sharpness]\n")
    assert load_spec(str(job)).to_worker_config().scorers == ("tiny", "sharpness")
    job.write_text(text + "\nquality:\n  scorers: [beauty]\n")
    with pytest.raises(SpecError, match=r"quality\.scorers") as refused:
        load_spec(str(job))
    assert "sharpness" in str(refused.value) and "tiny" in str(refused.value)


def test_preview_sorts_by_a_score_from_the_side_tables(tmp_path, capsys):
    from ditfleet.jobs.preview import collect_sorted

    root = tmp_path / "out"
    store = open_store(str(root))
    wrong = {0: Scene("circle", "green", "blue", "centre", "large").caption}  # 0.8: the colour is wrong
    _write_shard(store, 0, SCENES, captions=wrong)
    sheet = tmp_path / "sheet.png"
    assert main(["preview", str(root), "--out", str(sheet), "--sort", "tiny"]) == 2
    assert "ditfleet score" in capsys.readouterr().err  # nothing scored yet: says how to score
    assert main(["score", str(root), "--scorer", "tiny"]) == 0
    assert main(["preview", str(root), "--out", str(sheet), "--sort", "tiny", "--max", "2"]) == 0
    assert "2 images" in capsys.readouterr().out and Image.open(sheet).size[0] > 0
    lowest = collect_sorted(store, 3, "tiny")
    assert [(p.id, p.score) for p in lowest] == [("s0-0", 0.8), ("s0-1", 1.0), ("s0-2", 1.0)]
    assert [p.id for p in collect_sorted(store, 1, "tiny", best=True)] == ["s0-1"]  # ties: shard order


def test_the_model_based_scorers_are_refused_at_validate_time_without_their_model(tmp_path):
    from ditfleet.jobs.spec import SpecError, load_spec
    from tests.support.paths import REPO

    text = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()
    job = tmp_path / "job.yaml"
    job.write_text(text + "\nquality:\n  scorers: [clip]\n")
    with pytest.raises(SpecError, match=r"'clip' scorer .* needs quality\.clip_model"):
        load_spec(str(job))
    job.write_text(text + "\nquality:\n  scorers: [tiny]\n  gate: {scorer: clip, min: 20}\n")
    with pytest.raises(SpecError, match=r"quality\.clip_model"):
        load_spec(str(job))
    job.write_text(text + "\nquality:\n  scorers: [clip]\n  clip_model: models/clip\n")
    worker = load_spec(str(job)).to_worker_config()
    assert worker.scorers == ("clip",) and worker.clip_model == str(Path("models/clip").absolute())
    # the bundled tiny model's text encoder is not a Qwen2.5-VL: vqa has nothing to ask
    job.write_text(text + "\nquality:\n  scorers: [vqa]\n")
    with pytest.raises(SpecError, match=r"'vqa' asks .* model\.path 'tiny' has a tiny text encoder"):
        load_spec(str(job))


def test_score_with_clip_writes_its_table_from_the_given_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.support.clip_model import write_clip_model

    clip_dir = write_clip_model(tmp_path / "clip")
    root = tmp_path / "out"
    store = open_store(str(root))
    uris = _write_shard(store, 0, SCENES)
    assert main(["score", str(root), "--scorer", "clip"]) == 2  # no _job.json naming one: says what to give
    assert "--clip-model" in capsys.readouterr().err
    assert main(["score", str(root), "--scorer", "clip", "--clip-model", str(clip_dir)]) == 0
    table = pq.read_table(root / score_table_key("clip", manifest_key(0))).to_pylist()
    assert [t["uri"] for t in table] == uris
    assert all(0.0 <= t["score"] <= 100.0 for t in table)
    clip = scorer("clip", ScorerInputs(models={"clip": clip_dir}))
    assert [t["score"] for t in table] == [clip.score(_uint8(s)[None], [s.caption])[0] for s in SCENES]
