"""Every float setting is finite: `.nan`, `.inf` and `-.inf` in a job file are refused naming the
key, and a settings dataclass built in code refuses them naming its field (model.settings
check_settings). A gate's `min: .nan` once made every image max_tries times (every comparison with
NaN fails) and wrote a bare `NaN`, which is not JSON, into `_job.json`."""

from __future__ import annotations

import json
import math
import types
import typing

import pytest
from pydantic import BaseModel

from ditfleet.compile import CompileConfig
from ditfleet.driver.dispatch import DispatchConfig
from ditfleet.jobs.cli import main
from ditfleet.jobs.spec import JobSpec, SpecError, load_spec
from ditfleet.workers.contract import GateConfig
from ditfleet.workers.rows import RowConfig
from tests.unit.jobs.test_jobs_spec import minimal, write_job

NOT_FINITE = (".nan", ".inf", "-.inf")

# Each float of the job file, as YAML that sets it to {value} (test_every_float_key_is_listed
# keeps this list whole).
FLOAT_KEYS = {
    "sampling.true_cfg_scale": "sampling:\n  true_cfg_scale: {value}\n",
    "quality.gate.min": "quality:\n  scorers: [tiny]\n  gate: {{scorer: tiny, min: {value}}}\n",
    "workers.gpus": "workers:\n  gpus: {value}\n",
    "workers.cpus": "workers:\n  cpus: {value}\n",
    "workers.gpu_memory_gb": "workers:\n  gpu_memory_gb: {value}\n",
    "workers.idle_retire_s": "workers:\n  idle_retire_s: {value}\n",
    "workers.placement_timeout_s": "workers:\n  placement_timeout_s: {value}\n",
    "compile.claim_timeout_s": "compile:\n  claim_timeout_s: {value}\n",
    "model.loras.0.scale": "model:\n  loras:\n    - path: a.safetensors\n      scale: {value}\n",
    "cost.gpu_hour_usd": "cost:\n  gpu_hour_usd: {value}\n",
}


def _float_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The keys of every float field of the spec, walking its sections (a tuple of sections: .0)."""
    found = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        union = typing.get_args(field.annotation) if typing.get_origin(field.annotation) in _UNIONS else ()
        for arg in union or (field.annotation,):
            if arg is float:
                found.add(key)
            elif typing.get_origin(arg) in (tuple, list):
                found |= {
                    k
                    for sub in typing.get_args(arg)
                    if _is_section(sub)
                    for k in _float_keys(sub, f"{key}.0.")
                }
            elif _is_section(arg):
                found |= _float_keys(arg, f"{key}.")
    return found


_UNIONS = (typing.Union, types.UnionType)


def _is_section(tp: object) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def test_every_float_key_is_listed():
    assert _float_keys(JobSpec) == set(FLOAT_KEYS)


@pytest.mark.parametrize("value", NOT_FINITE)
@pytest.mark.parametrize("key", sorted(FLOAT_KEYS))
def test_a_float_that_is_not_finite_is_refused_naming_the_key(tmp_path, key, value):
    path = write_job(tmp_path, minimal(tmp_path, FLOAT_KEYS[key].format(value=value)))
    with pytest.raises(SpecError) as refused:
        load_spec(path)
    assert f"{key}: Input should be a finite number" in str(refused.value), str(refused.value)


def test_validate_refuses_a_nan_gate_and_no_job_file_gets_a_bare_nan(tmp_path, capsys):
    path = write_job(tmp_path, minimal(tmp_path, FLOAT_KEYS["quality.gate.min"].format(value=".nan")))
    assert main(["validate", str(path)]) == 2
    assert "quality.gate.min: Input should be a finite number" in capsys.readouterr().err
    assert main(["run", str(path)]) == 2
    assert not (tmp_path / "out").exists()  # refused before the output is claimed
    finite = write_job(
        tmp_path, minimal(tmp_path, FLOAT_KEYS["quality.gate.min"].format(value="0.5")), "ok.yaml"
    )
    json.loads(load_spec(finite).model_dump_json())  # what _job.json records: strict JSON


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_settings_built_in_code_refuse_what_is_not_finite_naming_the_field(value):
    with pytest.raises(ValueError, match=r"GateConfig\.min must be a finite number"):
        GateConfig(min=value)
    with pytest.raises(ValueError, match=r"RowConfig\.true_cfg_scale must be a finite number"):
        RowConfig(true_cfg_scale=value)
    with pytest.raises(ValueError, match=r"DispatchConfig\.idle_retire_s must be a finite number"):
        DispatchConfig(idle_retire_s=value)
    with pytest.raises(ValueError, match=r"CompileConfig\.claim_timeout_s must be a finite number"):
        CompileConfig(claim_timeout_s=value)


def test_step_cache_coefficients_must_be_finite(tmp_path):
    extra = "sampling:\n  step_cache: {method: teacache, coefficients: [1, 2, .nan, 4, 5]}\n"
    with pytest.raises(
        SpecError, match=r"sampling\.step_cache\.coefficients: expected a list of finite numbers"
    ):
        load_spec(write_job(tmp_path, minimal(tmp_path, extra)))
