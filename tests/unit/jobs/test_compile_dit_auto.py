"""compile.dit defaults to auto: off on CPU actors (fingerprints of CPU jobs unchanged), stated by `ditfleet plan`."""

from __future__ import annotations

from pathlib import Path

from ditfleet.compile.config import CompileConfig
from ditfleet.compile.policy import resolve_dit
from ditfleet.jobs.spec import load_spec


def test_default_is_auto_and_resolves_off_on_cpu():
    config = CompileConfig()
    assert config.dit == "auto"
    assert resolve_dit(config, "cpu", None, 3).dit is False
    assert resolve_dit(config, "cuda", None, 3).dit is True
    assert resolve_dit(config, "cuda", 10, 3).dit is False


def test_cpu_job_fingerprint_records_the_resolved_off(tmp_path):
    from ditfleet.jobs import __file__ as jobs_init

    examples = str(Path(jobs_init).parent / "examples" / "x")

    text = (Path(examples).parent / "tiny.yaml").read_text()
    assert "  dit: false\n" in text
    job = tmp_path / "job.yaml"
    job.write_text(text.replace("  dit: false\n", ""))
    explicit, default = load_spec(str(Path(examples).parent / "tiny.yaml")), load_spec(str(job))
    assert default.compile.dit == "auto"
    assert default.image_settings()["compile_dit"] is False
    assert default.image_settings() == explicit.image_settings()
