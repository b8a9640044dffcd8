"""Which DiT weights are stored in FP8, and how their GEMMs run: names and rules only, no torch.

    none             every weight in the load dtype (the exact path)
    fp8              Linear weights in float8 e4m3 with one fp32 scale per output channel;
                     activations quantized per token at run time; the GEMM on the FP8 matrix
                     units (torch._scaled_mm). Needs a GPU with FP8 units (compute capability
                     8.9+: Ada L4/L40S, Hopper H100/H200) or the CPU.
    fp8-weight-only  the same storage; each GEMM dequantizes its weight to the activation dtype
                     and runs in bf16 (A100 and older GPUs, the CPU).

Both halve the DiT's weight memory (40.9 -> 20.5 GB at Qwen-Image size) and change pixels, so a
job names the mode, the plan fingerprint carries it, and each manifest row records it.

Torch-free so that the job spec and `ditfleet plan` (model.memory) use the same rules as the
loader (model.qwen_image.fp8).
"""

from __future__ import annotations

import hashlib
import re
import typing

from ditfleet.model.settings import (
    Fp8Layers,
    Quantization,
)  # the knob (PipelineSettings.quantization) names the modes

QUANTIZATIONS: tuple[Quantization, ...] = typing.get_args(Quantization)

# The Linear layers that stay in the load dtype under every layer set, as full-match patterns on
# diffusers' module names: ~0.2% of the DiT's parameters (80 MB). The embedders see raw latents /
# text features, and the final layer writes the velocity directly, with no residual stream to
# dilute its error (bench/fp8.py, docs/real-model.md).
KEEP_IN_LOAD_DTYPE: tuple[str, ...] = (
    r"img_in",
    r"txt_in",
    r"time_text_embed\..*",
    r"norm_out\.linear",
    r"proj_out",
)

# The named layer sets (model.fp8_layers): which patterns each keeps in the load dtype.
#
# "all": every other Linear in FP8, the set ditfleet used before the choice existed (chosen on a
#   one-block random-weight measurement).
# "safe" (the default): "all" less each block's image MLP down-projection, following the published
#   evidence on real Qwen-Image images: SGLang's ModelOpt FP8 recipe keeps `img_mlp.net.2` in bf16,
#   and vLLM-Omni's all-layer FP8 measured LPIPS 0.30 against 0.17 with more layers kept. Its input
#   is the GELU output, the widest-ranging activation of the block (K = 4D), whose per-token FP8
#   scale loses the most. Costs 4 D^2 per block in the load dtype (2.3 GB at Qwen-Image size).
#
# Per stream, both sets decide alike (docs/real-model.md "FP8 layer sets"):
# - image stream (to_q/k/v, to_out.0, img_mlp): M = batch x image tokens (4096 at 1024x1024),
#   compute-bound GEMMs where FP8 matrix units pay (about 1.75x bf16 on Hopper).
# - text stream (add_q/k/v_proj, to_add_out, txt_mlp): M = batch x text length (<= 1024), GEMMs
#   bound by reading the weight, which FP8 halves; kept in bf16 it would cost 6.8 GB.
# - modulation (img_mod.1, txt_mod.1): a third of all weights, M = batch; under the `table`
#   modulation cache it runs once per bucket per actor, so its speed does not matter and FP8
#   saves 6.8 GB.
# The self-test measures every set's speed and relative error against bf16 (stage fp8_layers).
FP8_LAYER_SETS: dict[Fp8Layers, tuple[str, ...]] = {
    "all": KEEP_IN_LOAD_DTYPE,
    "safe": (*KEEP_IN_LOAD_DTYPE, r"transformer_blocks\.\d+\.img_mlp\.net\.2"),
}


def fp8_keep(layers: str, where: str = "model.fp8_layers") -> tuple[str, ...]:
    """The patterns layer set `layers` keeps in the load dtype, or a QuantizationError naming
    `where` and the sets."""
    if layers not in FP8_LAYER_SETS:
        raise QuantizationError(
            f"{where}: unknown FP8 layer set {layers!r}; use one of {', '.join(FP8_LAYER_SETS)}"
        )
    return FP8_LAYER_SETS[layers]


# torch._scaled_mm wants both GEMM dims in multiples of 16; a layer that is not runs weight-only.
FP8_GEMM_MULTIPLE = 16
# Compute capability from which NVIDIA GPUs have FP8 matrix units (Ada 8.9, Hopper 9.0, ...).
FP8_MIN_CAPABILITY = (8, 9)


class QuantizationError(ValueError):
    """A quantization the model or the device cannot do; the message says what to use instead."""


def check_quantization(name: str, where: str = "model.quantization") -> Quantization:
    """`name` as the typed choice, or a QuantizationError naming `where` and the choices."""
    if name not in QUANTIZATIONS:
        raise QuantizationError(
            f"{where}: unknown quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}"
        )
    return name


def quantized_revision(revision: str, name: Quantization, layers: Fp8Layers = "all") -> str:
    """The model revision a manifest records: FP8 weights are another model's numbers, so the
    quantization and its layer set are part of it (unchanged for "none", so existing outputs keep
    theirs; the layer set enters unless it is "all", the set those outputs were made with)."""
    if check_quantization(name) == "none":
        return revision
    fp8_keep(layers)
    named = f"{revision}:quantization:{name}" + (f":layers:{layers}" if layers != "all" else "")
    return hashlib.sha256(named.encode()).hexdigest()[:16]


def keeps_load_dtype(module_name: str, keep: tuple[str, ...] = KEEP_IN_LOAD_DTYPE) -> bool:
    """Whether the Linear named `module_name` stays unquantized under the `keep` patterns."""
    return any(re.fullmatch(p, module_name) for p in keep)


def check_fp8_device(
    name: Quantization, device_kind: str, capability: tuple[int, int] | None, device_name: str = ""
) -> None:
    """Refuse `fp8` on a device without FP8 matrix units, before any weight is read.

    device_kind: "cuda", "cpu", ...; capability: the CUDA compute capability (None elsewhere)."""
    check_quantization(name)
    if name != "fp8" or device_kind == "cpu":
        return  # torch._scaled_mm has a CPU kernel (which scales it takes: model.qwen_image.fp8.gemm_support)
    if device_kind == "cuda" and capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY:
        return
    what = f"{device_name or device_kind}" + (
        f" (compute capability {capability[0]}.{capability[1]})" if capability else ""
    )
    raise QuantizationError(
        f"model.quantization: fp8 needs FP8 matrix units (NVIDIA compute capability "
        f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+: L4, L40S, H100, H200), but this actor has {what}. "
        "Use quantization: fp8-weight-only: the same FP8 weights and memory, computed in bf16."
    )


# -- how an fp8 GEMM applies its scales ------------------------------------------------------------
#
# "rowwise": torch._scaled_mm takes the per-token and per-channel scales itself (one kernel).
# "tensorwise": it takes unit per-tensor scales and returns fp32; the same two scales are applied
#   to that product afterwards (the same quantization and products, one more elementwise pass).
# "weight-only": no _scaled_mm kernel at all here; the layer dequantizes its weight (fp8-weight-only).
FP8_SCALE_KINDS = ("rowwise", "tensorwise", "weight-only")

# cuBLASLt before CUDA 13.0 refuses row-wise scaled GEMMs on Hopper with a large K and M <= 256
# (CUBLAS_STATUS_NOT_SUPPORTED; pytorch/ao#4582: K=9216 fails, K=3072 works; fixed in CUDA 13.0).
# Qwen-Image's MLP down-projections (K=12288) meet it on every text-stream call. M is the batch
# times the text length, a dynamic size in a compiled graph, so the rule cannot branch on it
# without a recompile: on those builds every layer with K above this runs tensorwise.
ROWWISE_MAX_K_BEFORE_CUDA13 = 3072
HOPPER_MAJOR = 9


def rowwise_max_k(cuda_version: str | None, capability: tuple[int, int] | None) -> int | None:
    """The largest K a row-wise fp8 GEMM may have on this CUDA build and GPU (None: no limit).

    cuda_version: torch.version.cuda ("12.9", "13.0", None on a CPU build)."""
    if not cuda_version or capability is None or capability[0] != HOPPER_MAJOR:
        return None
    try:
        major = int(str(cuda_version).split(".")[0])
    except ValueError:
        return ROWWISE_MAX_K_BEFORE_CUDA13  # an unreadable version: the safe side
    return ROWWISE_MAX_K_BEFORE_CUDA13 if major < 13 else None


def layer_scale_kind(device_kind: str, in_features: int, max_k: int | None) -> str:
    """How one fp8 layer with `in_features` (K) runs, given what the device's kernel takes:
    `device_kind` one of FP8_SCALE_KINDS (the device's best), `max_k` the largest K it takes
    row-wise (None: any)."""
    if device_kind not in FP8_SCALE_KINDS:
        raise ValueError(f"fp8 scale kind must be one of {FP8_SCALE_KINDS}, got {device_kind!r}")
    if device_kind == "rowwise" and max_k is not None and in_features > max_k:
        return "tensorwise"
    return device_kind
