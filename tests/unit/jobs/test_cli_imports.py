"""`ditfleet validate` and `ditfleet plan` load neither torch, nor Ray, nor the model's torch modules
(nor boto3, for a job whose paths are all local).

Each command runs in a fresh interpreter (what a user's shell gets) through `jobs.cli.main`, which
then reports the modules it loaded. The model's memory plan reads configs and safetensors headers
through torch-free modules of `model`; those, and only those, may load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.paths import REPO

ROOT = REPO
TINY_JOB = ROOT / "jobs" / "examples" / "tiny.yaml"

# The model modules that planning reads (configs, safetensors headers, memory arithmetic).
TORCH_FREE_MODEL = {
    "model",
    "ditfleet.model.loading.folder",
    "ditfleet.model.generation.guidance",  # the CFG rule and the default negative prompt (the spec's default)
    "ditfleet.model.lazy_exports",  # the packages' load-on-first-use attributes
    "ditfleet.model.loading.lora_spec",
    "ditfleet.model.step_cache_config",  # step-cache presets and checks (the spec validates them)
    "ditfleet.model.memory",
    "ditfleet.model.qwen_image.memory_activations",
    "ditfleet.model.memory.disk",
    "ditfleet.model.qwen_image.memory_params",
    "ditfleet.model.memory.plan",
    "ditfleet.model.qwen_image.transformer_config",
    "ditfleet.model.qwen_image.vae_config",
    "ditfleet.model.quality",  # names load on first use: the table alone is read
    "ditfleet.model.quality.table",  # the scorers, one row each (the spec's checks and choices)
}

REPORT = """
import json, sys
from ditfleet.jobs.cli import main
code = main(sys.argv[1:])
print("MODULES " + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def loaded_by(*argv: str) -> tuple[int, str, set[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", REPORT, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MODULES ")), None)
    assert line is not None, f"ditfleet {' '.join(argv)} exited {proc.returncode}:\n{proc.stderr}"
    report = json.loads(line[len("MODULES ") :])
    return report["code"], proc.stdout, set(report["modules"])


def memory_checked_job(tmp_path: Path) -> Path:
    """tiny.yaml (`model: {path: tiny}`) with a GPU memory limit: validate then reads the model too."""
    spec = yaml.safe_load(TINY_JOB.read_text())
    spec["input"]["path"] = str(ROOT / spec["input"]["path"])
    spec["output"]["uri"] = str(tmp_path / "out")
    spec["workers"]["gpu_memory_gb"] = 80
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("command", ["validate", "plan"])
@pytest.mark.parametrize("job", ["tiny", "memory-checked"])
def test_validate_and_plan_load_no_torch_ray_or_model_code(command, job, tmp_path):
    path = TINY_JOB if job == "tiny" else memory_checked_job(tmp_path)
    code, out, modules = loaded_by(command, str(path))
    assert code == 0
    if command == "plan" or job == "memory-checked":  # the model's configs were read
        assert "memory: " in out and " GB" in out
    tops = {m.split(".")[0] for m in modules}
    assert "torch" not in tops
    assert "ray" not in tops
    # Both jobs read local files: the S3 client (boto3) is loaded only where an s3:// path is.
    assert "boto3" not in tops and "botocore" not in tops
    model = {m for m in modules if m.split(".")[0] == "model"}
    assert model <= TORCH_FREE_MODEL, f"model modules with torch loaded: {sorted(model - TORCH_FREE_MODEL)}"
    assert (
        not {"ditfleet.workers.actor", "ditfleet.workers.text_embeddings", "ditfleet.compile.policy"}
        & modules
    )
