"""`ditfleet submit`: submission ids per (job name, slot), and a real `ray start --head` cluster
to which a scheduler that fires twice for one slot submits the job: one job runs."""

from __future__ import annotations

from pathlib import Path

from ditfleet.jobs.cli import main
from ditfleet.jobs.submit import MAX_ID_CHARS, entrypoint, exit_code, submission_id


def test_submission_ids_are_stable_safe_and_distinct():
    assert submission_id("qwen-image-nightly", "2024-06-01") == "ditfleet-qwen-image-nightly-2024-06-01"
    odd = [("My Job", "2024/06/01"), ("my-job", "2024-06-01"), ("my job", "2024 06 01"), ("x" * 300, "s")]
    ids = [submission_id(n, s) for n, s in odd]
    assert len(set(ids)) == len(ids), ids
    for sid in ids:
        assert len(sid) <= MAX_ID_CHARS and all(c.isalnum() or c in "-_" for c in sid) and sid == sid.lower()
    assert ids[0].startswith("ditfleet-my-job-2024-06-01-") and ids[1] == "ditfleet-my-job-2024-06-01"


def test_entrypoint_names_the_job_file_inside_the_working_dir(tmp_path: Path):
    (tmp_path / "jobs").mkdir()
    assert entrypoint(str(tmp_path / "jobs" / "a b.yaml"), str(tmp_path)) == "ditfleet run 'jobs/a b.yaml'"
    assert entrypoint("/etc/ditfleet/job.yaml", str(tmp_path)) == "ditfleet run /etc/ditfleet/job.yaml"
    assert entrypoint("/etc/ditfleet/job.yaml", None) == "ditfleet run /etc/ditfleet/job.yaml"


def test_exit_codes_follow_the_driver():
    assert exit_code("RUNNING", None) is None and exit_code("PENDING", None) is None
    assert exit_code("SUCCEEDED", 0) == 0
    assert exit_code("FAILED", 1) == 1 and exit_code("FAILED", 2) == 2
    assert (
        exit_code("FAILED", None) == 1 and exit_code("FAILED", 137) == 1 and exit_code("STOPPED", None) == 1
    )


def test_a_job_without_a_name_is_refused_before_any_cluster(tmp_path: Path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(f"input: {{path: {tmp_path}/p.parquet}}\noutput: {{uri: {tmp_path}/out}}\n")
    assert main(["submit", str(job), "--address", "http://127.0.0.1:9", "--slot", "s"]) == 2
    assert "the job has no `name`" in capsys.readouterr().err
