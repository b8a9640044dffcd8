"""sampling.cfg_table (issue 50, lever 3): `cfg_mode: auto` picks serial or batched CFG by the
self-test's measurement per bucket and batch; a bad table is refused naming its file and key;
without a table (or for a bucket it lacks) the fixed rule stays."""

from __future__ import annotations

import json

import pytest

from ditfleet.model.cfg_table import CfgEntry, CfgTable, CfgTableError, cfg_table_value, parse_cfg_table
from ditfleet.model.generation.pipeline import cfg_batched_for
from ditfleet.model.qwen_image.memory_activations import image_tokens

# 1024x1024: 4096 image tokens; 512x512: 1024.
GOOD = {
    "format": 1,
    "device": "NVIDIA H100 80GB HBM3",
    "entries": [
        {"size": "1024x1024", "batch": 1, "serial_ms": 250.0, "batched_ms": 244.0},  # batched pays
        {"size": "1024x1024", "batch": 4, "serial_ms": 990.0, "batched_ms": 1010.0},  # serial pays
        {"size": "512x512", "batch": 1, "serial_ms": 70.0, "batched_ms": 75.0},  # serial pays
    ],
}


def _write(tmp_path, raw) -> str:
    path = tmp_path / "cfg_table.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(path)


def test_auto_picks_by_the_measured_bucket_and_batch(tmp_path):
    table = parse_cfg_table(_write(tmp_path, GOOD))
    assert isinstance(table, CfgTable) and table.device == "NVIDIA H100 80GB HBM3"
    # 1024x1024 batch 1: the fixed rule says serial (4096 + 60 tokens fill a pass); measured batched
    assert cfg_batched_for("auto", "cuda", 1, 4096, 60, 4) is False
    assert cfg_batched_for("auto", "cuda", 1, 4096, 60, 4, table) is True
    # batch 2 and 3 read batch 1's measurement, batch 4 and above batch 4's
    assert cfg_batched_for("auto", "cuda", 3, 4096, 60, 4, table) is True
    assert cfg_batched_for("auto", "cuda", 4, 4096, 60, 4, table) is False
    assert cfg_batched_for("auto", "cuda", 9, 4096, 60, 4, table) is False
    # 512x512 batch 1: the fixed rule batches (1084 tokens, 0.1% pad); measured serial
    assert cfg_batched_for("auto", "cuda", 1, 1024, 60, 58) is True
    assert cfg_batched_for("auto", "cuda", 1, 1024, 60, 58, table) is False
    # a bucket the table lacks keeps the fixed rule, either way it goes
    assert cfg_batched_for("auto", "cuda", 1, 256, 60, 58, table) is True
    assert cfg_batched_for("auto", "cuda", 1, 6889, 60, 1, table) is False
    # the CPU stays serial and an explicit mode is itself, table or not
    assert cfg_batched_for("auto", "cpu", 1, 4096, 60, 4, table) is False
    assert cfg_batched_for("serial", "cuda", 1, 4096, 60, 4, table) is False
    assert cfg_batched_for("batched", "cuda", 1, 1024, 60, 58, table) is True


def test_a_batch_below_every_measured_one_reads_the_smallest():
    table = CfgTable("gpu", (CfgEntry(1024, 1024, 4, 100.0, 90.0), CfgEntry(1024, 1024, 8, 100.0, 110.0)))
    assert table.batched(4096, 1, image_tokens) is True
    assert table.batched(4096, 7, image_tokens) is True
    assert table.batched(4096, 8, image_tokens) is False
    assert table.batched(1024, 1, image_tokens) is None


def test_the_table_round_trips_through_its_json_form(tmp_path):
    table = parse_cfg_table(_write(tmp_path, GOOD))
    dumped = cfg_table_value(table)
    assert dumped == GOOD
    assert parse_cfg_table(dumped) == table
    assert parse_cfg_table(None) is None and cfg_table_value(None) is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "not valid JSON"),
        ([], "expected a JSON object"),
        ({**GOOD, "format": 2}, "format: expected 1, got 2"),
        ({**GOOD, "extra": 1}, "unknown keys ['extra']"),
        ({**GOOD, "device": ""}, "device: expected the GPU's name"),
        ({**GOOD, "entries": []}, "entries: expected a non-empty list"),
        (
            {**GOOD, "entries": [{"size": "1024x1024", "batch": 1, "serial_ms": 1.0}]},
            "entries[0]: missing keys ['batched_ms']",
        ),
        ({**GOOD, "entries": [{**GOOD["entries"][0], "size": "1024"}]}, "entries[0].size: expected 'WxH'"),
        (
            {**GOOD, "entries": [{**GOOD["entries"][0], "batch": 0}]},
            "entries[0].batch: expected a whole number",
        ),
        ({**GOOD, "entries": [{**GOOD["entries"][0], "batch": True}]}, "entries[0].batch"),
        (
            {**GOOD, "entries": [GOOD["entries"][0], {**GOOD["entries"][1], "serial_ms": -1}]},
            "entries[1].serial_ms",
        ),
        ({**GOOD, "entries": [{**GOOD["entries"][0], "batched_ms": "fast"}]}, "entries[0].batched_ms"),
        (
            {**GOOD, "entries": [GOOD["entries"][0], GOOD["entries"][0]]},
            "entries[1]: size 1024x1024 batch 1 is measured twice",
        ),
    ],
)
def test_a_bad_table_is_refused_naming_the_file_and_key(tmp_path, raw, says):
    path = _write(tmp_path, raw)
    with pytest.raises(CfgTableError) as e:
        parse_cfg_table(path)
    assert path in str(e.value) and says in str(e.value)


def test_the_spec_reads_the_table_and_hands_it_to_every_actor(tmp_path):
    from ditfleet.jobs.spec import JobSpec

    base = {"input": {"path": str(tmp_path / "p.parquet")}, "output": {"uri": str(tmp_path / "o")}}
    path = _write(tmp_path, GOOD)
    spec = JobSpec.model_validate({**base, "sampling": {"cfg_table": path}})
    table = spec.to_worker_config().pipeline.cfg_table
    assert table == parse_cfg_table(path)
    # the resolved spec and the fingerprint carry the table itself, not where it lay
    assert spec.image_settings()["cfg_table"] == GOOD
    assert "cfg_table" not in JobSpec.model_validate(base).image_settings()
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match=r"sampling.cfg_table: cannot read .*none.json"):
        JobSpec.model_validate({**base, "sampling": {"cfg_table": missing}})
    with pytest.raises(ValueError, match=r"cfg_table.json: entries\[0\].batch"):
        bad = {**GOOD, "entries": [{**GOOD["entries"][0], "batch": -2}]}
        JobSpec.model_validate({**base, "sampling": {"cfg_table": _write(tmp_path, bad)}})
