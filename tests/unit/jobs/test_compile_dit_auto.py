"""compile.vae and compile.dit default to auto: both off on CPU actors (the DiT's fingerprints of CPU jobs
unchanged; the VAE's recorded as resolved), on for GPU actors (the DiT when enough images repay it),
stated by `ditfleet plan`."""

from __future__ import annotations

from pathlib import Path

from ditfleet.compile.config import CompileConfig
from ditfleet.compile.policy import resolve_auto
from ditfleet.jobs.spec import load_spec


def test_default_is_auto_and_resolves_off_on_cpu():
    config = CompileConfig()
    assert config.dit == "auto"
    assert resolve_auto(config, "cpu", None, 3).dit is False
    assert resolve_auto(config, "cuda", None, 3).dit is True
    assert resolve_auto(config, "cuda", 10, 3).dit is False


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


def test_vae_auto_compiles_on_gpu_actors_only():
    config = CompileConfig()
    assert config.vae == "auto"
    assert resolve_auto(config, "cpu", None, 3).vae is False
    assert resolve_auto(config, "cuda", 1, 3).vae is True  # the device decides, not the image count
    assert resolve_auto(CompileConfig(vae=True), "cpu", None, 1).vae is True
    assert resolve_auto(CompileConfig(vae=False), "cuda", None, 1).vae is False


def test_vae_auto_is_in_the_fingerprint_as_resolved(tmp_path):
    from ditfleet.jobs import __file__ as jobs_init

    text = (Path(jobs_init).parent / "examples" / "tiny.yaml").read_text()
    assert "  vae: auto" in text

    def spec_with(replacement: str):
        job = tmp_path / "job.yaml"
        job.write_text(text.replace("  gpus: 0 ", replacement) if "gpus" in replacement else text)
        return load_spec(str(job))

    on_cpu = spec_with("")
    assert on_cpu.image_settings()["compile_vae"] is False
    assert on_cpu.memory_request().vae_batch is None  # an eager decode takes the batch whole
    on_gpu = spec_with("  gpus: 1 ")
    assert on_gpu.image_settings()["compile_vae"] is True
    assert on_gpu.memory_request().vae_batch == 1
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text(text.replace("  vae: auto", "  vae: true"))
    assert load_spec(str(explicit)).image_settings()["compile_vae"] is True


def test_plan_says_what_vae_auto_resolves_to(capsys):
    from ditfleet.jobs.cli import main
    from tests.support.paths import REPO

    assert main(["plan", str(REPO / "jobs" / "examples" / "tiny.yaml")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("compile:"))
    assert line.startswith(
        "compile: vae auto -> off (CPU actors: a bucket's compile is repaid after about 4,000"
    )
    assert "compile.vae: true to compile" in line and "; dit off" in line
