"""FP8 layer sets (model.fp8_layers, model.loading.quantization.FP8_LAYER_SETS): each set quantizes
exactly the Linears it names, loading and quantizing a loaded model agree, its error next to bf16
stays within the bound docs/real-model.md states, the knob is checked, fingerprinted and part of
the model revision, the memory plan counts what it keeps, and the compiled image stream multiplies
its activation without a spare row."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from ditfleet.compile.compiled_method import _symbolic_sizes
from ditfleet.jobs.spec import JobSpec
from ditfleet.model import load_pipeline
from ditfleet.model.loading.quantization import (
    FP8_LAYER_SETS,
    QuantizationError,
    fp8_keep,
    quantized_revision,
)
from ditfleet.model.qwen_image.fp8 import Fp8Linear, quantize_model
from ditfleet.model.qwen_image.memory_params import transformer_weight_bytes
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.settings import PipelineSettings
from ditfleet.testing.outliers import cast_inputs, forward_inputs, outlier_transformer, relative_error

# Kept in the load dtype by every set: the embedders, the timestep MLP and the final layer.
ALWAYS_KEPT = {"img_in", "txt_in", "norm_out.linear", "proj_out"} | {
    f"time_text_embed.timestep_embedder.linear_{i}" for i in (1, 2)
}
# The bound on one forward's relative error against fp32 (bf16 activations) that
# docs/real-model.md "FP8 layer sets" states for every set.
FP8_FORWARD_ERROR_BOUND = 0.06


def _expected_fp8(model: torch.nn.Module, layers: str) -> set[str]:
    """The Linears a set stores in FP8, written out by name (not through the set's patterns)."""
    linears = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))}
    blocks = range(len(model.transformer_blocks))
    kept = ALWAYS_KEPT | (
        {f"transformer_blocks.{i}.img_mlp.net.2" for i in blocks} if layers == "safe" else set()
    )
    return linears - kept


@pytest.mark.parametrize("layers", sorted(FP8_LAYER_SETS))
@pytest.mark.parametrize("mode", ["fp8", "fp8-weight-only"])
def test_each_set_quantizes_exactly_what_it_names(random_model_dir, layers, mode):
    loaded = load_pipeline(random_model_dir, quantization=mode, fp8_layers=layers).transformer
    fp8 = {n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == _expected_fp8(loaded, layers)
    assert all(type(loaded.get_submodule(n)) is torch.nn.Linear for n in ALWAYS_KEPT)
    # quantizing a loaded model with the set's patterns picks the same layers, the same bytes
    exact = load_pipeline(random_model_dir).transformer
    after = quantize_model(exact, mode, fp8_keep(layers)).state_dict()
    got = loaded.state_dict()
    assert set(after) == set(got)
    for k, v in after.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_the_default_set_is_safe_and_keeps_the_image_mlp_down_projection():
    assert PipelineSettings().fp8_layers == "safe"
    assert set(FP8_LAYER_SETS["safe"]) - set(FP8_LAYER_SETS["all"]) == {
        r"transformer_blocks\.\d+\.img_mlp\.net\.2"
    }
    with pytest.raises(QuantizationError, match="unknown FP8 layer set 'most'; use one of all, safe"):
        fp8_keep("most")


@pytest.mark.slow
def test_each_sets_forward_error_next_to_bf16_is_within_the_documented_bound():
    """One block at Qwen-Image's widths with outlier channels, bf16 activations: each set's
    relative error against fp32 stays under the documented bound, above bf16's own."""
    dit = outlier_transformer(num_layers=1, seed=0)
    inputs = forward_inputs(dit, grid=(4, 4), text_len=8)
    with torch.inference_mode():
        ref = dit(**inputs)
        bf16 = relative_error(
            copy.deepcopy(dit).to(torch.bfloat16)(**cast_inputs(inputs, torch.bfloat16)), ref
        )
    errors = {}
    for layers in FP8_LAYER_SETS:
        model = quantize_model(copy.deepcopy(dit), "fp8", fp8_keep(layers))
        for m in model.modules():  # the kept layers run in bf16 as on a GPU
            for name, p in list(m.named_parameters(recurse=False)):
                if p.dtype == torch.float32:
                    setattr(m, name, torch.nn.Parameter(p.to(torch.bfloat16), requires_grad=False))
        with torch.inference_mode():
            errors[layers] = relative_error(model(**cast_inputs(inputs, torch.bfloat16)), ref)
    assert all(bf16 < e < FP8_FORWARD_ERROR_BOUND for e in errors.values()), (bf16, errors)


def test_the_knob_is_checked_and_enters_the_fingerprint_only_beside_a_quantization():
    base = {"input": {"path": "/in.parquet"}, "output": {"uri": "/out"}}
    with pytest.raises(ValidationError, match="fp8_layers"):
        JobSpec.model_validate({**base, "model": {"fp8_layers": "most"}})
    with pytest.raises(ValueError, match="fp8_layers must be one of"):
        PipelineSettings(fp8_layers="most")  # type: ignore[arg-type]

    def fingerprint(**model) -> dict:
        return JobSpec.model_validate({**base, "model": model}).image_settings()

    assert "fp8_layers" not in fingerprint()  # no quantization: the set changes nothing
    assert "fp8_layers" not in fingerprint(fp8_layers="all")
    assert fingerprint(quantization="fp8")["fp8_layers"] == "safe"
    # "all" is what FP8 outputs were made with before the choice: they keep their fingerprint
    assert "fp8_layers" not in fingerprint(quantization="fp8", fp8_layers="all")
    spec = JobSpec.model_validate({**base, "model": {"quantization": "fp8", "fp8_layers": "all"}})
    assert spec.to_worker_config().pipeline.fp8_layers == "all"


def test_the_set_is_part_of_the_model_revision():
    assert quantized_revision("r", "none", "safe") == "r"
    assert quantized_revision("r", "fp8", "all") != quantized_revision("r", "fp8", "safe")
    # the revision FP8 manifests recorded before the choice: "all" keeps it
    import hashlib

    assert quantized_revision("r", "fp8", "all") == hashlib.sha256(b"r:quantization:fp8").hexdigest()[:16]


def test_the_memory_plan_counts_the_kept_layers(random_model_dir):
    import json

    cfg = TransformerConfig.from_dict(
        json.loads((random_model_dir / "transformer" / "config.json").read_text())
    )
    e, D = 2, cfg.inner_dim
    safe = transformer_weight_bytes(cfg, e, "fp8", "safe")
    every = transformer_weight_bytes(cfg, e, "fp8", "all")
    # per block, img_mlp.net.2 (4D -> D): e bytes a weight instead of one byte and an fp32 scale a row
    assert safe - every == cfg.num_layers * (4 * D * D * (e - 1) - 4 * D)
    loaded = load_pipeline(random_model_dir, dtype=torch.bfloat16, quantization="fp8").transformer
    held = sum(t.numel() * t.element_size() for t in (*loaded.parameters(), *loaded.buffers()))
    assert held >= safe  # the formula is a lower bound of what the module holds (its buffers beside)


@pytest.mark.parametrize(
    ("shape", "dynamic", "spare_row"), [((2, 16, 64), (0,), False), ((2, 5, 64), (0, 1), True)]
)
def test_compiled_image_stream_multiplies_without_a_spare_row(shape, dynamic, spare_row):
    """A static token count >= 2 (the image stream: batch x image tokens) proves M >= 2 from the
    shapes: no spare row is concatenated to its activation. The text stream (batch x text length,
    both dynamic) keeps one, so a one-token prompt at batch 1 needs no recompile."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32), "fp8")
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(*shape)
    for d in dynamic:
        torch._dynamo.mark_dynamic(x, d)
    with _symbolic_sizes():
        y = compiled(x)
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
    assert ("cat" in graphs[0].code) is spare_row
