"""The step cache as part of a job: the spec's key and its errors, the fingerprint, the summary's
share of reused work, and `ditfleet calibrate` on the tiny model (small n)."""

from __future__ import annotations

import json

import pytest

from ditfleet.driver.output.summary import step_cache_summary
from ditfleet.jobs.calibrate import format_calibration, wall_lag_reason
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import SpecError
from ditfleet.jobs.spec.file import parse_spec
from ditfleet.model.step_cache_config import PRESETS
from tests.support.paths import REPO

BASE = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()


def _spec(step_cache: str | None, steps: int = 50):
    text = BASE.replace("  steps: 20\n", f"  steps: {steps}\n")
    if step_cache is not None:
        text = text.replace(f"  steps: {steps}\n", f"  steps: {steps}\n  step_cache: {step_cache}\n")
    return parse_spec(text)


def test_off_keeps_the_fingerprint_and_a_preset_enters_it_resolved():
    assert "step_cache" not in _spec(None).image_settings()
    assert _spec("off").image_settings() == _spec(None).image_settings()
    safe = _spec("safe").image_settings()["step_cache"]
    assert safe["threshold"] == 0.12 and safe["compute_blocks"] == 8  # the settings, not the name
    assert _spec("{preset: safe, threshold: 0.1}").image_settings()["step_cache"]["threshold"] == 0.1
    fast = _spec("fast").image_settings()["step_cache"]
    assert fast["method"] == "teacache" and "compute_blocks" not in fast  # what acts, nothing else
    assert _spec("{preset: fast, taylorseer_order: 0}").image_settings()["step_cache"] != fast
    # Parsed once, in the spec: the worker gets the typed settings, the same as the fingerprint's.
    assert _spec("safe").sampling.step_cache == PRESETS["safe"]
    assert _spec("safe").to_worker_config().pipeline.step_cache == PRESETS["safe"]
    assert PRESETS["safe"].to_dict() == safe and _spec("off").to_worker_config().pipeline.step_cache is None
    assert _spec("safe").resolved()["sampling"]["step_cache"] == safe  # what _job.json stores


@pytest.mark.parametrize(
    ("value", "steps", "message"),
    [
        ("turbo", 50, "sampling.step_cache: unknown preset 'turbo'"),
        ("{method: fbcache}", 50, "sampling.step_cache.method: unknown method 'fbcache'"),
        (
            "{preset: fast, compute_blocks: 4}",
            50,
            "sampling.step_cache.compute_blocks: only method 'dbcache'",
        ),
        ("{taylorseer_order: -1}", 50, "sampling.step_cache.taylorseer_order: must be 0 (off) to 2"),
        ("{threshold: 1.2}", 50, "sampling.step_cache.threshold: must be in (0, 1)"),
        ("{max_skips: 3}", 50, "unknown key(s) ['max_skips']"),
        (
            "safe",
            8,
            "sampling.step_cache: the schedule is too short for a step cache (8 steps < min_steps 20)",
        ),
    ],
)
def test_bad_step_cache_settings_name_the_key(value, steps, message):
    with pytest.raises(SpecError) as err:
        _spec(value, steps)
    assert message in str(err.value)
    assert "sampling.step_cache: sampling.step_cache" not in str(err.value), "the key is named once"


def test_the_summary_states_the_share_of_reused_work():
    assert step_cache_summary(0, 0) == {}
    s = step_cache_summary(100, 70)
    assert s == {"blocks_computed": 100, "blocks_reused": 70, "reused_share": 0.4118, "work_speedup": 1.7}


@pytest.mark.slow
def test_calibrate_on_the_tiny_model(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(BASE.replace("batch_size: 8", "batch_size: 2"))
    # Two buckets of different sizes: adherence is scored per bucket.
    code = main(["calibrate", str(job), "--n", "1", "--bucket", "128x128", "--bucket", "160x96", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == 1 and out["steps"] == 20 and out["buckets"] == ["128x128", "160x96"]
    assert [p["preset"] for p in out["presets"]] == ["safe", "fast"]
    exact_adherence = out["exact"]["adherence"]
    assert set(exact_adherence) >= {"shape_color", "kind", "iou"}
    for p in out["presets"]:
        assert p["blocks_computed"] + p["blocks_reused"] == out["exact"]["blocks"]
        assert p["work_speedup"] > 1.0 and p["wall_speedup"] > 0
        assert p["psnr_mean_db"] > 30 and 0.9 < p["ssim_mean"] <= 1.0
        assert set(p["adherence"]) == set(exact_adherence)
    # The settings as the tiny model (4 blocks) runs them, not as the preset writes them.
    assert out["dit_layers"] == 4 and out["presets"][0]["runs_as"].startswith(
        "dbcache, threshold 0.12, compute_blocks 1 of 4"
    )
    text = format_calibration(out)
    assert "runs as: dbcache, threshold 0.12, compute_blocks 1 of 4" in text
    assert "compute_blocks: 8" not in text and '"compute_blocks":8' not in text
    for p in out["presets"]:
        lag = wall_lag_reason(p, out)
        if p["wall_speedup"] < 0.8 * p["work_speedup"]:
            assert (
                lag is not None and f"wall {p['wall_speedup']:.2f}x against" in lag and f"why: {lag}" in text
            )
        else:
            assert lag is None
    # Too short a schedule for the presets: an error before any work.
    assert main(["calibrate", str(job), "--n", "2", "--steps", "8"]) != 0
    assert "too short" in capsys.readouterr().err


def test_a_wall_time_below_the_work_gets_one_line_why():
    result = {"steps": 20, "dit_layers": 4, "batch_size": 2}
    slow = {"work_speedup": 1.15, "wall_speedup": 0.63}
    line = wall_lag_reason(slow, result)
    assert line is not None and "\n" not in line
    assert line.startswith("wall 0.63x against 1.15x less DiT work: the cache saves DiT blocks only")
    assert "4 blocks, batch 2, 20 steps" in line
    assert wall_lag_reason({"work_speedup": 2.0, "wall_speedup": 1.8}, result) is None
