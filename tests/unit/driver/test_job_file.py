"""`_job.json`: one schema for plain and incremental jobs, written create-only, and clear refusals
of an output whose `_job.json` belongs to another job, is damaged, or was not written by ditfleet."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ditfleet.driver.input.prompts import PromptSource
from ditfleet.driver.output.claim import claim_incremental_output, claim_output
from ditfleet.driver.output.job_file import JOB_FILE_VERSION, OutputMismatch, read_job_file, write_job_file
from ditfleet.driver.output.status import output_status
from ditfleet.driver.plan import JobPlan, PlanConfig, plan_job
from ditfleet.workers.output.layout import job_key
from ditfleet.workers.rows import RowConfig
from ditfleet.workers.storage import open_store
from ditfleet.workers.weights.digest import ModelIdentity, with_job_files


def plan_of(tmp_path: Path, seed: int = 1, shard_size: int = 2) -> JobPlan:
    path = tmp_path / "in" / "p.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"prompt": ["a", "b", "c"]}), path)
    config = PlanConfig(
        rows=RowConfig(job_seed=seed), shard_size=shard_size, image_settings={"model": "tiny"}
    )
    return plan_job(PromptSource(str(path)), config)


def test_plain_and_incremental_jobs_write_one_schema_create_only(tmp_path: Path):
    plan = plan_of(tmp_path)
    plain, incremental = open_store(str(tmp_path / "plain")), open_store(str(tmp_path / "incr"))
    assert claim_output(plain, plan, {"name": "p"}) is False  # claimed now
    fingerprint = claim_incremental_output(incremental, plan.config, "in/", {"name": "i"})
    docs = [json.loads(s.get(job_key())) for s in (plain, incremental)]
    assert [set(d) for d in docs] == [
        {"version", "spec", "fingerprint", "fingerprint_doc", "plan", "versions", "created_at"}
    ] * 2
    assert [d["version"] for d in docs] == [JOB_FILE_VERSION] * 2
    assert docs[0]["fingerprint"] == plan.fingerprint() and docs[1]["fingerprint"] == fingerprint
    assert docs[0]["plan"]["shards"] == 2 and docs[1]["plan"] == {
        "source": "in/", "incremental": True, "shard_size": 2
    }  # fmt: skip

    before = plain.get(job_key())
    assert write_job_file(plain, {"version": JOB_FILE_VERSION}) is False  # create-only
    assert plain.get(job_key()) == before and read_job_file(plain) == docs[0]
    assert claim_output(plain, plan, {"name": "p"}) is True  # a resume


def test_a_mismatch_names_the_output_and_every_difference(tmp_path: Path):
    store = open_store(str(tmp_path / "out"))
    claim_output(store, plan_of(tmp_path), {})
    before = store.get(job_key())
    with pytest.raises(OutputMismatch) as err:
        claim_output(store, plan_of(tmp_path, seed=5, shard_size=3), {})
    message = str(err.value)
    assert message.startswith(f"output {store.uri()} belongs to another job")
    assert "  - job_seed: 1 in the existing output, 5 now\n" in message
    assert "  - shard_size: 2 in the existing output, 3 now\n" in message
    assert message.endswith("Write to a new output, or run with the settings and input it was made with")
    assert store.get(job_key()) == before


def test_the_models_bytes_are_checked_by_whoever_knows_them(tmp_path: Path):
    """An output records its model's digest; a driver with other weights is refused naming the
    file, and a caller that reads no weights (`ditfleet plan`) compares everything else."""
    weights = ModelIdentity("sha256", {"transformer/model.safetensors": "ab" * 32})
    other = ModelIdentity("sha256", {"transformer/model.safetensors": "cd" * 32})
    plain, incremental = open_store(str(tmp_path / "plain")), open_store(str(tmp_path / "incr"))
    plan = plan_of(tmp_path)
    assert claim_output(plain, plan, {}, model=weights) is False
    claim_incremental_output(incremental, plan.config, "in/", {}, model=weights)
    assert claim_output(plain, plan, {}, model=weights) is True
    assert claim_output(plain, plan, {}) is True
    claim_incremental_output(incremental, plan.config, "in/", {}, write=False)
    with pytest.raises(OutputMismatch, match=r"transformer/model\.safetensors changed"):
        claim_output(plain, plan, {}, model=other)
    with pytest.raises(OutputMismatch, match="job_seed: 1 in the existing output, 5 now"):
        claim_incremental_output(incremental, plan_of(tmp_path, seed=5).config, "in/", {}, write=False)
    # The LoRA files and the scheduler config a job names are part of the model's identity.
    adapted = open_store(str(tmp_path / "adapted"))
    lora = {
        "LoRA 0 /loras/a.safetensors": "sha256:" + "ef" * 32,
        "scheduler config /s.json": "sha256:" + "01" * 32,
    }
    claim_output(adapted, plan, {}, model=with_job_files(weights, lora))
    for key in lora:
        replaced = with_job_files(weights, {**lora, key: "sha256:" + "99" * 32})
        with pytest.raises(OutputMismatch, match=f"{key} changed .* since the output was made"):
            claim_output(adapted, plan, {}, model=replaced)


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"{not json", r"_job\.json is not valid JSON .*Restore it from a backup, or write to a new output"),
        (b"[1, 2]", r"_job\.json does not hold a JSON object.*Restore it from a backup"),
        (b'{"hello": 1}', r"_job\.json is not a ditfleet job file \(version None, expected 1\).*Restore it"),
        (b'{"version": 7, "fingerprint": "x"}', r"_job\.json has version 7; this ditfleet reads version 1"),
        (b'{"version": 1, "fingerprint": "x"}', r"_job\.json has no valid 'fingerprint_doc'.*Restore it"),
    ],
    ids=["corrupt", "not-an-object", "foreign", "newer", "no-fingerprint-doc"],
)
def test_a_damaged_or_foreign_job_file_is_refused_naming_it(tmp_path: Path, content: bytes, expected: str):
    store = open_store(str(tmp_path / "out"))
    store.put(job_key(), content)
    plan = plan_of(tmp_path)
    with pytest.raises(OutputMismatch, match=expected) as err:
        claim_output(store, plan, {})
    assert store.uri(job_key()) in str(err.value)
    with pytest.raises(OutputMismatch, match=expected):
        claim_incremental_output(store, plan.config, "in/", {}, write=False)
    assert store.get(job_key()) == content  # left as it was
    if not content.startswith(b"{"):  # `ditfleet status` shows what is there, but not a broken file
        with pytest.raises(OutputMismatch, match=expected):
            output_status(store)
