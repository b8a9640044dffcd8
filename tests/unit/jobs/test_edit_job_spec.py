"""An edit job's spec: input.image_column goes with an edit model and only with one, refused by
`ditfleet validate` (and so plan and run) before any work, saying what to do; `validate` names a
missing image column and an unreadable source URI with file, row and column."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import SpecError, parse_spec


def _edit_model(folder: Path) -> Path:
    """What the spec reads of an edit checkpoint: its model_index.json (the weights are read by
    the actors)."""
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    return folder


def _job(tmp_path: Path, model: str, image_column: str | None, images: list | None = None) -> str:
    table = {"prompt": ["make the shape blue", "make it red"], "image": images or ["a.png", "b.png"]}
    pq.write_table(pa.table(table), tmp_path / "p.parquet")
    column = f"\n  image_column: {image_column}" if image_column else ""
    return (
        f"input:\n  path: {tmp_path / 'p.parquet'}{column}\noutput:\n  uri: {tmp_path / 'out'}\n"
        f"model:\n  path: {model}\n"
    )


def test_an_edit_job_needs_an_edit_model_and_an_edit_model_an_edit_job(tmp_path):
    with pytest.raises(
        SpecError,
        match="input.image_column is set \\('image': an edit job\\), but model.path 'tiny' is a text-to-image model",
    ):
        parse_spec(_job(tmp_path, "tiny", "image"))
    model = _edit_model(tmp_path / "edit-model")
    with pytest.raises(SpecError, match="is an edit model: it edits source images.*Set input.image_column"):
        parse_spec(_job(tmp_path, str(model), None))
    spec = parse_spec(_job(tmp_path, str(model), "image"))
    assert spec.row_config().image_column == "image"
    assert spec.image_settings()["image_column"] == "image"  # other sources, other images
    assert "image_column" not in parse_spec(_job(tmp_path, "tiny", None)).image_settings()
    # A remote model's model_index.json is not read here: the actor checks it when fetched.
    parse_spec(_job(tmp_path, "s3://bucket/models/anything", "image"))


def test_validate_names_a_missing_image_column_and_an_unreadable_scheme(tmp_path, capsys):
    model = _edit_model(tmp_path / "edit-model")
    (tmp_path / "job.yaml").write_text(_job(tmp_path, str(model), "picture"))
    assert main(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'p.parquet'}: column 'picture': no 'picture' column, which input.image_column names"
        in err
    )
    (tmp_path / "job.yaml").write_text(
        _job(tmp_path, str(model), "image", ["a.png", "https://example.com/b.png"])
    )
    assert main(["validate", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{tmp_path / 'p.parquet'}: row 1, column 'image': 'https://example.com/b.png': the scheme https:// cannot be read"
        in err
    )
