"""The quality gate on the real actor and the bundled tiny model (workers.quality_gate): an image
under quality.gate.min is made again with the next seed of its fixed sequence, the row keeps its
best try and records every try; only kept tries are ever stored; the same shard makes the same
tries on a rerun, also after a run abandoned mid-retry."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from ditfleet.workers.actor import GenerationWorker
from ditfleet.workers.contract import GateConfig, ShardAbandoned
from ditfleet.workers.generate import image_seed, try_seed
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

BUCKETS = ("128x128",)  # the tiny model's own size: at 2 steps about one image in eight misses
GATE_COLUMNS = ("score_tiny", "gate_passed", "gate_kept", "gate_scores", "gate_seeds", "sha256")


def _worker(tmp_path: Path, out: str, gate: GateConfig, steps: int = 2) -> GenerationWorker:
    rows = row_config(steps=steps, cfg=2.0, buckets=BUCKETS)
    return GenerationWorker(
        dataclasses.replace(worker_config("tiny", str(tmp_path / out), rows=rows), gate=gate)
    )


def _run(worker: GenerationWorker, prompts: Path, n: int) -> list[dict]:
    """The shard's manifest rows, the gate's JSON lists read as lists."""
    result = worker.run_shard(shard_of(prompts, 0, 0, n, buckets=BUCKETS))
    assert result.images_ok == n
    rows = read_manifests(open_store(worker.config.output_uri)).to_pylist()
    for r in rows:
        r["gate_scores"], r["gate_seeds"] = json.loads(r["gate_scores"]), json.loads(r["gate_seeds"])
        assert r["gate_tries"] == len(r["gate_scores"])
    return rows


def _stored(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "images").rglob("*.png")}


def test_try_seeds_are_a_fixed_sequence_starting_at_the_image_seed():
    seed = image_seed(1234, 0)
    sequence = [try_seed(seed, t) for t in range(4)]
    assert sequence[0] == seed == 1234
    assert len(set(sequence)) == 4 and sequence == [try_seed(seed, t) for t in range(4)]
    assert try_seed(image_seed(1234, 1), 1) != sequence[1]  # image k=1 has a sequence of its own


@pytest.mark.slow
def test_the_gate_makes_an_image_again_and_keeps_its_best_try(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.parquet", 8, sizes=False)
    gate = GateConfig("tiny", min=1.0, max_tries=3)
    rows = _run(_worker(tmp_path, "a", gate), prompts, 8)
    retried = [r for r in rows if len(r["gate_scores"]) > 1]
    assert retried, "at 2 steps some image misses its caption on the first try"
    for r in rows:
        scores, seeds, kept = r["gate_scores"], r["gate_seeds"], r["gate_kept"]
        assert seeds == [try_seed(image_seed(r["seed"], r["k"]), t) for t in range(len(scores))]
        assert scores[kept] == r["score_tiny"] == max(scores)
        assert kept == scores.index(max(scores))  # ties keep the earlier try
        if r["gate_passed"]:
            assert kept == len(scores) - 1 and scores[kept] >= 1.0  # it stopped at the passing try
        else:
            assert len(scores) == 3 and max(scores) < 1.0
    # Only kept tries were stored: one image per row, the manifest's bytes.
    stored = _stored(tmp_path / "a")
    assert sorted(stored.values()) == sorted(r["sha256"] for r in rows)
    # `ditfleet status` (and the run's summary, from the same counts) says how the gate went.
    from ditfleet.driver.output.status import output_status

    status = output_status(open_store(str(tmp_path / "a")))
    passed, tries = sum(bool(r["gate_passed"]) for r in rows), sum(len(r["gate_scores"]) for r in rows)
    assert status.to_dict()["quality_gate"] == {
        "images": 8, "passed": passed, "pass_rate": round(passed / 8, 4), "tries_per_image": round(tries / 8, 3),
    }  # fmt: skip
    assert f"quality gate: {passed}/8 images passed" in status.format_text()
    # The same shard makes the same tries and keeps the same images on another run.
    again = _run(_worker(tmp_path, "b", gate), prompts, 8)
    assert [{c: r[c] for c in GATE_COLUMNS} for r in again] == [{c: r[c] for c in GATE_COLUMNS} for r in rows]


@pytest.mark.slow
def test_a_min_no_image_reaches_makes_every_try_and_keeps_the_best(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.parquet", 3, sizes=False)
    rows = _run(_worker(tmp_path, "out", GateConfig("tiny", min=1.5, max_tries=2)), prompts, 3)
    for r in rows:
        assert len(r["gate_scores"]) == 2 and r["gate_passed"] is False
        assert r["gate_kept"] == r["gate_scores"].index(max(r["gate_scores"]))
    assert len(_stored(tmp_path / "out")) == 3


class _StopWhileRetrying:
    """The real tiny scorer; at its `after`-th call it asks the worker to stop (as SIGTERM does),
    which lands while the gate's second round is under way."""

    def __init__(self, worker: GenerationWorker, after: int) -> None:
        self.inner, self.worker, self.calls, self.after = worker.scorers[0], worker, 0, after
        self.name, self.higher_is_better = self.inner.name, self.inner.higher_is_better

    def score(self, pixels, prompts):
        self.calls += 1
        if self.calls == self.after:
            self.worker._stop.set()
        return self.inner.score(pixels, prompts)


@pytest.mark.slow
def test_a_run_abandoned_mid_retry_stores_no_losing_try_and_its_rerun_makes_the_same_tries(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.parquet", 8, sizes=False)
    gate = GateConfig("tiny", min=1.0, max_tries=3)
    clean = _run(_worker(tmp_path, "clean", gate), prompts, 8)
    first_round = len(clean)  # every image's first try is scored before any second try
    assert any(len(r["gate_scores"]) > 1 for r in clean)

    worker = _worker(tmp_path, "out", gate)
    worker.scorers = [_StopWhileRetrying(worker, after=first_round + 1)]
    with pytest.raises(ShardAbandoned):
        worker.run_shard(shard_of(prompts, 0, 0, 8, buckets=BUCKETS))
    root = tmp_path / "out"
    assert not (root / "manifests").exists()  # nothing committed
    # What the abandoned run stored are kept tries only (the clean run's own images), under its
    # attempt token, which no manifest names: the orphans the one deletion rule removes.
    assert set(_stored(root).values()) <= {r["sha256"] for r in clean}

    rerun = _run(_worker(tmp_path, "out", gate), prompts, 8)
    assert [{c: r[c] for c in GATE_COLUMNS} for r in rerun] == [
        {c: r[c] for c in GATE_COLUMNS} for r in clean
    ]
