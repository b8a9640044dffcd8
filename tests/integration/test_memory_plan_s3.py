"""The memory plan of a model that lives in a bucket, read from its config files over a real S3 endpoint."""

from __future__ import annotations

import pytest

from tests.unit.driver.test_memory_plan import PUBLISHED


def test_a_model_in_a_bucket_is_planned_from_its_config_files(s3_server, s3_bucket):
    from ditfleet.driver.memory_plan import MemoryPlanError, MemoryRequest, job_memory_plan
    from ditfleet.workers.storage import StoreError, open_store

    uri = f"s3://{s3_bucket}/models/qwen-image"
    store = open_store(uri, s3_server.config())
    for part in ("transformer", "vae", "text_encoder"):
        store.put(f"{part}/config.json", (PUBLISHED / part / "config.json").read_bytes())
    request = MemoryRequest(
        model_path=uri, buckets=("1328x1328",), batch_size=8, text_encoder="cpu", gpu_memory_gb=48,
        s3=s3_server.config(),
    )  # fmt: skip
    plan = job_memory_plan(request)
    assert plan is not None and plan.model.params()["transformer"] == 20_430_401_088
    with pytest.raises(MemoryPlanError, match="the largest batch that fits 48 GB is 5"):
        plan.check("job.yaml")
    store.delete("vae/config.json")
    with pytest.raises(StoreError, match=rf"s3://{s3_bucket}/models/qwen-image/vae/config.json: missing"):
        job_memory_plan(request)


def test_a_diffusers_checkpoint_in_a_bucket_is_measured_not_planned_and_refused_when_it_cannot_run(
    s3_server, s3_bucket
):
    """model_index.json names the family: a FluxPipeline runs through diffusers (no plan from
    configs: its memory is measured at warm-up); one needing an input ditfleet has no column for (a mask) is
    refused at plan time."""
    import json

    from ditfleet.driver.memory_plan import MemoryRequest, job_memory_plan
    from ditfleet.model.loading.folder import WeightsError
    from ditfleet.workers.storage import open_store

    uri = f"s3://{s3_bucket}/models/flux"
    store = open_store(uri, s3_server.config())
    components = {
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    store.put("model_index.json", json.dumps({"_class_name": "FluxPipeline", **components}).encode())
    request = MemoryRequest(model_path=uri, buckets=("1024x1024",), batch_size=2, s3=s3_server.config())
    assert job_memory_plan(request) is None
    store.delete("model_index.json")
    # An image-to-image pipeline runs (as an edit job's model); one that needs a mask does not.
    store.put("model_index.json", json.dumps({"_class_name": "FluxInpaintPipeline", **components}).encode())
    with pytest.raises(
        WeightsError,
        match=r"models/flux/model_index.json: FluxInpaintPipeline needs \['mask_image'\], an input",
    ):
        job_memory_plan(request)
