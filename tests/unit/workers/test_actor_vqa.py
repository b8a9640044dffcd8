"""`vqa` where images are made: a job whose model has a Qwen2.5-VL text encoder of the published
layout (tiny: tests/support/qwen_text_encoder.py) asks it of every image on the actor. Each
manifest row carries a probability, the one `ditfleet score --scorer vqa` reads back from the
stored file; under a gate on vqa, every try's score is such a probability and the kept try is
the best one."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from ditfleet.jobs.cli import main  # noqa: E402
from ditfleet.jobs.spec import JobSpec  # noqa: E402
from ditfleet.workers.output.layout import manifest_key, score_table_key  # noqa: E402
from ditfleet.workers.output.manifest import read_manifests  # noqa: E402
from ditfleet.workers.storage import open_store  # noqa: E402
from tests.support.qwen_text_encoder import write_qwen_model_dir  # noqa: E402
from tests.support.worker_fixtures import shard_of, write_prompts  # noqa: E402

BUCKETS = ("64x64",)
N = 3


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    return write_qwen_model_dir(tmp_path_factory.mktemp("qwen-image") / "model")


def _run(tmp_path, model, quality: dict) -> list[dict]:
    """One shard of N prompts through the actor, configured from a job spec as `ditfleet run` does."""
    from ditfleet.workers.actor import GenerationWorker

    prompts = write_prompts(tmp_path / "prompts.parquet", N, sizes=False)
    spec = JobSpec.model_validate(
        {
            "input": {"path": str(prompts)},
            "output": {"uri": str(tmp_path / "out")},
            "model": {"path": str(model), "device": "cpu"},
            "sampling": {"steps": 2, "true_cfg_scale": 1.0},
            "buckets": {"names": list(BUCKETS)},
            "compile": {"vae": False, "dit": False},
            "workers": {"batch_size": 2},
            "quality": quality,
        }
    )
    result = GenerationWorker(spec.to_worker_config()).run_shard(shard_of(prompts, 0, 0, N, buckets=BUCKETS))
    assert result.images_ok == N
    return read_manifests(open_store(spec.output_uri())).to_pylist()


@pytest.mark.slow
def test_vqa_on_the_actor_is_a_probability_per_row_equal_to_ditfleet_score(tmp_path, qwen_model):
    manifest = _run(tmp_path, qwen_model, {"scorers": ["vqa"]})
    scores = [r["score_vqa"] for r in manifest]
    assert len(scores) == N and all(0.0 < s < 1.0 for s in scores), scores
    assert len(set(scores)) == N  # each image and prompt asked on its own
    out = tmp_path / "out"
    assert main(["score", str(out), "--scorer", "vqa", "--model", str(qwen_model)]) == 0
    table = pq.read_table(out / score_table_key("vqa", manifest_key(0))).to_pylist()
    read_back = {t["uri"]: t["score"] for t in table}
    assert read_back == pytest.approx({r["uri"]: r["score_vqa"] for r in manifest}, rel=1e-6)


@pytest.mark.slow
def test_a_gate_on_vqa_keeps_each_images_best_try(tmp_path, qwen_model):
    # min 1: no probability passes, so every image is tried max_tries times and keeps its best
    gate = {"scorer": "vqa", "min": 1.0, "max_tries": 2}
    manifest = _run(tmp_path, qwen_model, {"scorers": ["vqa"], "gate": gate})
    for r in manifest:
        tries = json.loads(r["gate_scores"])
        assert (r["gate_tries"], r["gate_passed"], len(set(json.loads(r["gate_seeds"])))) == (2, False, 2)
        assert all(0.0 < s < 1.0 for s in tries), tries
        assert r["score_vqa"] == tries[r["gate_kept"]] == max(tries)
