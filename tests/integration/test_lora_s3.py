"""LoRA adapters and a scheduler config read from S3 (a real moto HTTP server) by the worker."""

from __future__ import annotations

import pytest
import torch

from ditfleet.model import load_pipeline
from ditfleet.model.qwen_image.lora import LoraError, LoraSpec
from tests.unit.model.test_lora import LIGHTNING_SCHEDULER, _bad, write_kohya_lora


def test_worker_merges_adapters_and_manifests_name_the_revision(
    tmp_path, random_model_dir, s3_server, s3_bucket, s3_config
):
    """The job's model.loras and model.scheduler_config reach load_pipeline through the worker
    (here from S3, through the node's model cache), and every manifest row carries the revision
    of base + adapters + schedule."""
    import dataclasses

    from ditfleet.workers.actor import GenerationWorker
    from ditfleet.workers.output.manifest import read_manifests
    from ditfleet.workers.storage import open_store
    from tests.support.worker_fixtures import row_config, shard_of, worker_config, write_prompts

    prompts = write_prompts(tmp_path / "prompts.parquet", 3)
    adapter = write_kohya_lora(tmp_path / "adapter.safetensors", 9, flat=True)
    schedule = LIGHTNING_SCHEDULER / "scheduler_config.json"
    s3_server.admin.upload_file(str(adapter), s3_bucket, "loras/adapter.safetensors")
    s3_server.admin.upload_file(str(schedule), s3_bucket, "loras/scheduler_config.json")
    rows = row_config(steps=4, cfg=1.0)
    base = GenerationWorker(worker_config(random_model_dir, str(tmp_path / "base"), rows=rows))
    remote = (LoraSpec(f"s3://{s3_bucket}/loras/adapter.safetensors", 0.9),)
    config = dataclasses.replace(
        worker_config(random_model_dir, str(tmp_path / "lora"), rows=rows, s3=s3_config),
        model_cache_dir=str(tmp_path / "cache"),
        loras=remote,
        scheduler_config=f"s3://{s3_bucket}/loras/scheduler_config.json",
    )
    worker = GenerationWorker(config)
    assert worker.startup_report()["loras"] == [{"path": remote[0].path, "scale": 0.9}]
    # The revision follows the bytes, not where they came from.
    local = load_pipeline(
        random_model_dir,
        loras=[LoraSpec(str(adapter), 0.9)],
        scheduler_config=schedule,
        load_text_encoder_too=False,
    )
    assert worker.pipe.model_revision == local.model_revision
    assert worker.pipe.scheduler == local.scheduler != base.pipe.scheduler
    for w in (base, worker):
        assert w.run_shard(shard_of(prompts, 0, 0, 3)).images_ok == 3
    with_lora = read_manifests(open_store(str(tmp_path / "lora"))).to_pandas()
    without = read_manifests(open_store(str(tmp_path / "base"))).to_pandas()
    assert set(with_lora["model_revision"]) == {worker.pipe.model_revision}
    assert set(without["model_revision"]) == {base.pipe.model_revision} != {worker.pipe.model_revision}
    assert not set(with_lora["sha256"]) & set(without["sha256"])  # other model, other images

    bad = _bad(
        tmp_path / "other.safetensors",
        {"x.lora_A.weight": torch.zeros(1, 2), "x.lora_B.weight": torch.zeros(2, 1)},
    )
    with pytest.raises(LoraError, match=r"other\.safetensors: none of its 2 keys"):
        GenerationWorker(dataclasses.replace(config, loras=(LoraSpec(str(bad)),)))
