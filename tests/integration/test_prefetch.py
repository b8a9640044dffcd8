"""The next shard prepared while the current one generates, on a real local Ray: the real worker
(tiny random model, real Parquet) behind an input store that answers 0.3 s late
(ditfleet.testing.slow_input), dispatched by the real policy with and without prefetch."""

from __future__ import annotations

import pytest

from ditfleet.driver.dispatch import DispatchConfig, run_shards
from ditfleet.testing.slow_input import SlowInputWorker, read_log, shard_gaps
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

pytestmark = pytest.mark.usefixtures("ray_cluster")

LATENCY_S = 0.3  # each shard's read; a shard's 8 images at 30 steps take about 1 s on a CPU
SHARDS, ROWS = 4, 8


def _run(model_dir, prompts, tmp_path, prefetch: bool):
    out, log = tmp_path / f"out-{prefetch}", tmp_path / f"events-{prefetch}.jsonl"
    worker = worker_config(model_dir, str(out), rows=row_config(steps=30))
    shards = [shard_of(prompts, i, i * ROWS, (i + 1) * ROWS) for i in range(SHARDS)]
    config = DispatchConfig(
        min_actors=1, max_actors=1, num_cpus=1, speculative_tail=False, tick_s=0.1, prefetch=prefetch
    )
    result = run_shards(shards, SlowInputWorker, (worker, LATENCY_S, str(log)), config)
    assert sorted(r.shard for r in result.results) == list(range(SHARDS)) and not result.failed
    table = read_manifests(open_store(str(out))).to_pandas()
    assert len(table) == SHARDS * ROWS and table["status"].eq("ok").all()
    images = dict(zip(zip(table["id"], table["k"]), table["sha256"]))
    return result, read_log(log), images


def test_the_next_shard_is_read_while_the_current_one_generates(random_model_dir, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.parquet", SHARDS * ROWS)
    ahead, ahead_events, ahead_images = _run(random_model_dir, prompts, tmp_path, prefetch=True)
    plain, plain_events, plain_images = _run(random_model_dir, prompts, tmp_path, prefetch=False)

    assert ahead_images == plain_images, "prefetch changes when rows are read, never the images"
    by_shard = {r.shard: r for r in ahead.results}
    assert ahead.stats.prefetches == SHARDS - 1 and plain.stats.prefetches == 0
    # The first shard is read when it starts; every later one was read ahead, and its run
    # found it ready (it waited for none of the store's latency).
    assert not by_shard[0].prefetched and by_shard[0].input_wait_s >= LATENCY_S
    for k in range(1, SHARDS):
        assert by_shard[k].prefetched and by_shard[k].input_wait_s < LATENCY_S / 3, by_shard[k]
    assert all(not r.prefetched and r.input_wait_s >= LATENCY_S for r in plain.results)

    # The event order: shard k+1's rows were read, on another thread, before shard k's images
    # were all made (shard 1's beside shard 0's own read, the others while the shard generated).
    at = {(e["event"], e["shard"]): e for e in ahead_events}
    for k in range(SHARDS - 1):
        generating = (at["generate_start", k]["t"], at["generate_end", k]["t"])
        read = at["read_start", k + 1], at["read_end", k + 1]
        assert read[1]["t"] < generating[1], (k, generating, read)
        assert read[0]["thread"] != at["generate_start", k]["thread"]
    # Without prefetch the device waits for each read between two shards.
    gaps_ahead, gaps_plain = shard_gaps(ahead_events), shard_gaps(plain_events)
    assert len(gaps_ahead) == len(gaps_plain) == SHARDS - 1
    assert min(gaps_plain) >= LATENCY_S and max(gaps_ahead) < LATENCY_S / 2, (gaps_ahead, gaps_plain)
