"""docs/job-file.md is the job file's reference, written from the spec's fields
(jobs/spec/reference.py): every key a job file may hold is in it, with a meaning, and the page is
exactly what the generator writes (`make docs`), so it cannot go stale."""

from __future__ import annotations

from ditfleet.jobs.spec.reference import REFERENCE_PATH, job_file_reference, reference_keys
from tests.support.paths import REPO


def test_every_job_file_key_is_in_the_reference_with_a_meaning():
    text = (REPO / REFERENCE_PATH).read_text()
    keys = dict(reference_keys())
    # The keys the issue found only in the example job, and one of a nested section.
    for key in (
        "shards.size",
        "workers.gpus",
        "workers.cpus",
        "workers.batch_size",
        "buckets.names",
        "output.image_format",
        "quality.gate.max_tries",
        "model.loras[].scale",
    ):
        assert key in keys
    missing = [key for key in keys if f"`{key}`" not in text]
    assert not missing, f"{REFERENCE_PATH} lacks {missing}: run `make docs`"
    assert all(info.description for info in keys.values()), "a job-file key without a description"


def test_the_reference_is_what_the_generator_writes():
    assert (REPO / REFERENCE_PATH).read_text() == job_file_reference(), (
        f"{REFERENCE_PATH} is stale: run `make docs` (python -m ditfleet.jobs.spec.reference > {REFERENCE_PATH})"
    )
