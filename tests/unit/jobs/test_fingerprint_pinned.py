"""Every existing output keeps its fingerprint: `JobSpec.image_settings()` pinned, byte for byte.

The digests were recorded from the code that planned the outputs users have (the README job and one
spec per optional entry). A change here refuses to resume every such output ("fingerprint
differs"): never update a digest to make this pass; make the new setting enter only when set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from ditfleet.jobs.spec import JobSpec, load_spec
from ditfleet.jobs.spec.derive import fingerprint_entries
from ditfleet.model.knobs import setting

TINY_JOB = Path(__file__).resolve().parents[3] / "jobs" / "examples" / "tiny.yaml"

CASES: dict[str, dict] = {
    "readme_job": {},
    "model_folder": {"model": {"path": "/w/qwen-image"}},
    "loras": {"model": {"loras": [{"path": "/w/a.safetensors"}, {"path": "/w/b.safetensors", "scale": 0.5}]}},
    "scheduler_config": {"model": {"scheduler_config": "/w/scheduler_config.json"}},
    "gate_tiny": {"quality": {"gate": {"scorer": "tiny", "min": 0.8, "max_tries": 2}}},
    "gate_clip": {"quality": {"clip_model": "/w/clip", "gate": {"scorer": "clip", "min": 20.0}}},
    "clip_scorer_no_gate": {"quality": {"clip_model": "/w/clip", "scorers": ["clip"]}},
    "embed_metadata_off": {"output": {"embed_metadata": False}},
    "unnamed": {"name": None},
    "lossy": {"output": {"image_format": "webp", "quality": 90, "format": "parquet"}},
    # Outputs planned before model.fp8_layers existed quantized every layer: naming "all" keeps
    # their fingerprint; the default set ("safe") makes other images, so it enters and such an
    # output resumed with it is refused (quantization_safe_layers).
    "quantization": {"model": {"quantization": "fp8-weight-only", "fp8_layers": "all"}},
    "quantization_safe_layers": {"model": {"quantization": "fp8-weight-only"}},
    "fp8_layers_without_quantization": {"model": {"fp8_layers": "safe"}},
    "attention_backend": {"model": {"attention_backend": "math"}},
    "pixel_knobs_at_default": {"model": {"quantization": "none", "attention_backend": "auto"}},
    "step_cache_safe": {"sampling": {"step_cache": "safe"}},
    "step_cache_mapping": {"sampling": {"step_cache": {"preset": "fast", "threshold": 0.2}}},
    "step_cache_off": {"sampling": {"step_cache": "off"}},
    "not_pixels": {"model": {"modulation_cache": "table", "text_encoder": "cpu"}, "workers": {"cpus": 2}},
    "cfg_and_length": {"sampling": {"cfg_mode": "batched"}, "model": {"max_sequence_length": 256}},
    "fp32_batch_2": {"model": {"dtype": "fp32"}, "workers": {"batch_size": 2}},
    "cpu_device": {"model": {"device": "cpu"}, "compile": {"vae": "auto", "dit": "auto"}},
    "cuda_gpu_auto": {"model": {"device": "cuda"}, "workers": {"gpus": 1}, "compile": {"dit": "auto"}},
    "cuda_gpu_on": {"workers": {"gpus": 1}, "compile": {"vae": True, "dit": True}},
    "cpu_compile_on": {"compile": {"vae": True, "dit": True}},
}

PINNED = {
    "attention_backend": "228349f076040f7d87d2a8858230532fcd9219125199cc2ec74f091eae6fff23",
    "cfg_and_length": "818608a6db350ae296a61a35f490e5bb12c09039924b2e0f1d4a9fa6fb80457b",
    "clip_scorer_no_gate": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "cpu_compile_on": "5017feeac17b241ad16e990b46bf4d426494e24b23619826501bbaddb312b502",
    "cpu_device": "3b78e2ca357bebee3f9639179d4ba519a384f4d36ca10dfac72179f363bf0784",
    "cuda_gpu_auto": "a4b08e7f1647dbcc73fed47bd6c614fa979a2309bd34ba1e11ffc8c12a3386da",
    "cuda_gpu_on": "5017feeac17b241ad16e990b46bf4d426494e24b23619826501bbaddb312b502",
    "embed_metadata_off": "bc02d491227a76cfacf8b6fa0ea6d7761cc9c695f571a0d06017190eb9e50581",
    "fp32_batch_2": "baaa54de14fd0212459e744b0f76ecf128e9041dc1fdd8246105dcf3f95a70cb",
    "gate_clip": "a6881877665163c6e58ba8d92a87e9098011a3f034bf2b3b19bc3abaf3c4a499",
    "gate_tiny": "f4ddd876725fd6489320c99b78dc281f61f2acd446d9f65960d739b7764d2108",
    "loras": "80bbd90e4e8a240fb62a046d338f0350c2efd41ac2ed7cb6d6c7fe563a902ed7",
    "lossy": "c7fa7e7adeeedb80b01bc986f9bd4b25c520dbae71d1b984b723dc804dfe1d32",
    "model_folder": "9416431586a93529b292e14ad333ca93ac81450c2aa44d0ec24fe2a64cf26695",
    "not_pixels": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "pixel_knobs_at_default": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "quantization": "1d2c41dce6c4bc576deab38bbe4126f96f620a9cd8d987a952fb5ea8d8b702dd",
    "quantization_safe_layers": "7e78b1f267b91952df38e0c7b275b2741ebe0c76bf6cc08dc12b4013b521cdf4",
    "fp8_layers_without_quantization": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "readme_job": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "scheduler_config": "50800a42767d2915a257055bcdfd0c898ed110da065b2d0a2030e0bf28e772fe",
    "step_cache_mapping": "a3bfa6f54ce92ec92dcbb43a6b8c81bbe7ae76cfcac26b99ba0ff688ce866536",
    "step_cache_off": "5ccb9784503ed8430ce5c94e83770b2003d1cdcfcf754d676e85dafe9b8c4e9d",
    "step_cache_safe": "f65f734e679ce648b24efec44f7a578ed1e5e4f5cc38b28130ac514210567126",
    "unnamed": "4dbce5a4b35859c6623ee2ec17415646448361ed38274eb2a050341a08a3007d",
}


def _spec(case: str) -> JobSpec:
    spec = load_spec(str(TINY_JOB))
    return spec.with_changes(**CASES[case]) if CASES[case] else spec


def _digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_image_settings_keep_their_fingerprint(case):
    settings = _spec(case).image_settings()
    assert _digest(settings) == PINNED[case], json.dumps(settings, sort_keys=True, indent=1)


def test_two_knobs_entering_under_one_key_are_refused():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        size: int = setting(1, fingerprint="always", description="d")

    @dataclasses.dataclass(frozen=True)
    class Outer:
        width: int = setting(2, fingerprint="always", fingerprint_key="size", description="d")
        inner: Inner = dataclasses.field(default_factory=Inner)

    with pytest.raises(TypeError, match="Inner.size: another knob enters the fingerprint as 'size'"):
        fingerprint_entries(Outer())
