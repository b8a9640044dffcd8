"""What the quality gate's retries cost, where users read it: `ditfleet plan` (the bounds on the
work before a run) and the summary of `ditfleet run`/`_SUCCESS` (the share of the generating work
and of the fleet's hours that went to tries beyond each image's first)."""

from __future__ import annotations

import json

import pytest

from ditfleet.driver.output.status import gate_line
from ditfleet.driver.output.summary import gate_with_cost
from ditfleet.jobs.cli import main
from tests.support.paths import REPO

GATE = {"images": 48, "passed": 45, "pass_rate": 0.9375, "tries_per_image": 1.25}


def test_retries_take_their_share_of_the_generating_gpu_hours():
    fleet = {"gpu_hours": 3.0, "startup_gpu_hours": 0.5, "generating_gpu_hours": 2.0, "idle_gpu_hours": 0.5}
    gate = gate_with_cost(GATE, fleet)
    assert gate["retry_share"] == 0.2  # 1.25 tries an image: 0.25 of every 1.25 tries are retries
    assert gate["retry_gpu_hours"] == pytest.approx(0.4)
    assert gate_line(gate) == (
        "45/48 images passed (93.8%), 1.25 tries per image; retries 20.0% of the generating work (0.40 GPU hours)"
    )


def test_without_gpus_the_account_is_in_actor_hours_and_without_a_fleet_the_share_alone():
    gate = gate_with_cost(GATE, {"actor_hours": 1.0, "generating_actor_hours": 0.5})
    assert gate["retry_actor_hours"] == pytest.approx(0.1) and "(0.10 actor hours)" in gate_line(gate)
    alone = gate_with_cost(GATE, {})
    assert alone["retry_share"] == 0.2 and gate_line(alone).endswith("retries 20.0% of the generating work")
    assert gate_with_cost({}, {"gpu_hours": 1.0}) == {}  # no gate, nothing added
    assert gate_line(GATE) == "45/48 images passed (93.8%), 1.25 tries per image"  # status: counts only


def test_plan_bounds_the_work_of_a_gated_job(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    text = (REPO / "jobs" / "examples" / "tiny.yaml").read_text()
    text = text.replace("jobs/examples/prompts.parquet", str(REPO / "jobs" / "examples" / "prompts.parquet"))
    job.write_text(text + "\nquality:\n  scorers: [tiny]\n  gate: {scorer: tiny, min: 0.8, max_tries: 3}\n")
    assert main(["plan", str(job)]) == 0
    out = capsys.readouterr().out
    assert (
        "quality gate: tiny >= 0.8, up to 3 tries an image: 48-144 images generated (1-3x the DiT work)"
        in out
    )
    assert main(["plan", str(job), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["quality_gate"]["most_images_generated"] == 144
