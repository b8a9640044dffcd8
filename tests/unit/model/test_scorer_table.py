"""The scorer table (model.quality.table) is the one place a scorer is described: the spec's
choices, the manifest's score_* columns, the knob's documentation, what a job must give and what
a model family must offer all come from its rows."""

from __future__ import annotations

import json
import typing

import pyarrow as pa
import pytest

from ditfleet.jobs.spec import JobSpec, SpecError, parse_spec
from ditfleet.model.family import model_family
from ditfleet.model.quality.table import (
    MODEL,
    NOTHING,
    PIPELINE_QWEN_VL,
    SCORER_NAMES,
    SCORERS,
    ScorerName,
    ScorerRow,
    check_scorers_supported,
    needing,
    scorer_row,
)
from ditfleet.model.qwen_image.family import QWEN_IMAGE, TINY
from ditfleet.workers.contract import WorkerConfig
from ditfleet.workers.output.manifest import MANIFEST_SCHEMA, ManifestRow, manifest_table

JOB = {"input": {"path": "in.parquet"}, "output": {"uri": "out"}}


def _spec(doc: dict) -> JobSpec:
    return parse_spec(json.dumps(doc), "job.json")


def test_the_names_and_columns_come_from_the_rows() -> None:
    assert typing.get_args(ScorerName) == SCORER_NAMES == ("sharpness", "tiny", "vqa", "clip")
    columns = [f for f in MANIFEST_SCHEMA if f.name.startswith("score_")]
    assert [f.name for f in columns] == [row.manifest_column for row in SCORERS]
    for f, row in zip(columns, SCORERS, strict=True):
        assert f.type == pa.float64() and f.nullable and f.metadata[b"doc"] == row.column_doc.encode()
    description = WorkerConfig.__dataclass_fields__["scorers"].metadata["description"]
    assert all(f"'{row.name}' ({row.doc})" in description for row in SCORERS)


def test_a_manifest_row_takes_scores_by_name_and_refuses_others() -> None:
    base = dict(id="a", k=0, prompt="p", seed=0, width=8, height=8, bucket="8x8", steps=1, true_cfg_scale=1.0)
    base.update(model_id="m", status="failed", error="x", format="png", worker="w", attempt=0, shard=0)
    table = manifest_table([ManifestRow(**base, scores={"sharpness": 0.5, "clip": None})])
    assert table.column("score_sharpness").to_pylist() == [0.5]
    assert table.column("score_tiny").to_pylist() == table.column("score_clip").to_pylist() == [None]
    with pytest.raises(ValueError, match="'beauty' is no scorer"):
        ManifestRow(**base, scores={"beauty": 1.0})
    with pytest.raises(ValueError, match="score_tiny must be a number"):
        ManifestRow(**base, scores={"tiny": "high"})


def test_needs() -> None:
    assert [r.name for r in needing(["clip", "vqa", "sharpness", "clip"], MODEL)] == ["clip"]
    assert [r.name for r in needing(["tiny", "vqa"], PIPELINE_QWEN_VL)] == ["vqa"]
    assert scorer_row("sharpness").needs == NOTHING and scorer_row("clip").setting_key == "quality.clip_model"
    with pytest.raises(ValueError, match="unknown image scorer 'beauty'.*clip, sharpness, tiny, vqa"):
        scorer_row("beauty")
    with pytest.raises(ValueError, match="a setting and a model"):
        ScorerRow("aesthetic", "doc", "column", True, MODEL)  # a model of its own needs its setting


def test_a_family_without_a_qwen_vl_cannot_run_a_scorer_that_asks_one() -> None:
    assert model_family("tiny") is TINY and PIPELINE_QWEN_VL not in TINY.scorer_inputs
    check_scorers_supported(QWEN_IMAGE, ["vqa", "tiny", "clip"])
    check_scorers_supported(TINY, ["tiny", "sharpness", "clip"])
    check_scorers_supported({PIPELINE_QWEN_VL}, ["vqa"])
    with pytest.raises(
        ValueError, match=r"'vqa' asks the model's own Qwen2\.5-VL .* the tiny model family has none"
    ):
        check_scorers_supported(TINY, ["sharpness", "vqa"])
    with pytest.raises(ValueError, match="'vqa' asks"):
        check_scorers_supported(frozenset(), ["vqa"])


def test_the_spec_refuses_what_a_row_needs_and_the_job_lacks() -> None:
    with pytest.raises(SpecError, match=r"'vqa' asks .* model\.path 'tiny' has a tiny text encoder"):
        _spec({**JOB, "quality": {"scorers": ["vqa"]}})
    with pytest.raises(
        SpecError, match=r"'clip' scorer .* needs quality\.clip_model: a folder holding a transformers"
    ):
        _spec({**JOB, "quality": {"scorers": ["clip"]}})
    with pytest.raises(SpecError, match="quality.scorers"):
        _spec({**JOB, "quality": {"scorers": ["beauty"]}})
    # A remote Qwen-Image model is taken at its family's word (its configs are not fetched to validate).
    spec: JobSpec = _spec({**JOB, "model": {"path": "s3://b/qwen"}, "quality": {"scorers": ["vqa"]}})
    assert spec.memory_request().vqa
    assert not _spec({**JOB, "quality": {"scorers": ["tiny"]}}).memory_request().vqa


def test_the_gate_s_own_model_enters_the_fingerprint_from_its_row(tmp_path) -> None:
    clip = str(tmp_path / "clip")
    gated = {"scorers": ["clip"], "clip_model": clip, "gate": {"scorer": "clip", "min": 20.0}}
    settings = _spec({**JOB, "quality": gated}).image_settings()
    assert settings["clip_model"] == clip and settings["quality_gate"]["scorer"] == "clip"
    ungated = _spec({**JOB, "quality": {"scorers": ["clip"], "clip_model": clip}}).image_settings()
    assert "clip_model" not in ungated
