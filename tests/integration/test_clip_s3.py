"""`clip` with its CLIP model at an s3:// prefix (moto over HTTP): the job's actors fetch it once
per node into the job's model cache (a second actor on the node, and `ditfleet score` there, read
the cached copy and download nothing), and the manifest's score_clip is what `ditfleet score`
reads back from the stored files. Every request goes through the recording proxy."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from ditfleet.driver.output.claim import claim_output
from ditfleet.driver.run_job import plan_input
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import JobSpec
from ditfleet.workers.output.layout import manifest_key, score_table_key
from ditfleet.workers.output.manifest import read_manifests
from ditfleet.workers.storage import open_store
from tests.integration.test_model_fetch import PREFIX, RequestLog, stage
from tests.support.fault_proxy import FaultPlan, Rule
from tests.support.worker_fixtures import write_prompts

pytest.importorskip("transformers")

N = 3


def test_a_clip_model_on_s3_is_fetched_once_per_node_and_scores_every_image(
    s3_server, s3_bucket, fault_proxy, tmp_path
):
    from ditfleet.workers.actor import GenerationWorker
    from tests.support.clip_model import write_clip_model

    sizes = stage(s3_server, s3_bucket, write_clip_model(tmp_path / "clip"))
    log = RequestLog(s3_bucket)
    fault_proxy.set_plan(FaultPlan(rules=[Rule(log.record, "reset")]))  # records, never fires
    prompts = write_prompts(tmp_path / "prompts.parquet", N, sizes=False)
    spec = JobSpec.model_validate(
        {
            "input": {"path": str(prompts)},
            "output": {"uri": str(tmp_path / "out")},
            "model": {"path": "tiny", "cache_dir": str(tmp_path / "node-cache")},
            "sampling": {"steps": 2},
            "buckets": {"names": ["128x128"]},
            "quality": {"scorers": ["clip"], "clip_model": f"s3://{s3_bucket}/{PREFIX}"},
            "s3": {"endpoint_url": fault_proxy.endpoint_url, "addressing_style": "path"},
        }
    )
    plan = plan_input(spec.to_driver_config())
    store = open_store(spec.output_uri())
    claim_output(store, plan, spec.resolved())  # _job.json names the CLIP model and the cache

    GenerationWorker(spec.to_worker_config())  # the node's first actor fetches the CLIP model
    assert log.objects("GET") == {rel: 1 for rel in sizes}  # every file of the folder, once
    assert len(list((tmp_path / "node-cache").glob("*/model.safetensors"))) == 1  # in the job's cache
    second = GenerationWorker(spec.to_worker_config())  # another actor on the same node
    assert second.run_shard(plan.shards[0]).images_ok == N
    manifest = read_manifests(store).to_pylist()
    assert all(0.0 <= r["score_clip"] <= 100.0 for r in manifest) and len(manifest) == N

    args = ["score", spec.output_uri(), "--scorer", "clip", "--endpoint-url", fault_proxy.endpoint_url]
    assert main(args) == 0
    assert sum(log.objects("GET").values()) == len(sizes)  # neither the actor nor score fetched again
    table = pq.read_table(tmp_path / "out" / score_table_key("clip", manifest_key(0))).to_pylist()
    assert {t["uri"]: t["score"] for t in table} == pytest.approx(
        {r["uri"]: r["score_clip"] for r in manifest}, abs=1e-4
    )
