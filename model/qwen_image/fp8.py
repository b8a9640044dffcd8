"""FP8 DiT weights: `Fp8Linear` and the quantizer that fills it while the checkpoint streams in.

The rules (modes, which layers stay in the load dtype, which devices can run `fp8`) live in the
torch-free model.loading.quantization; this is the arithmetic.

Weights: float8 e4m3 (max 448), one fp32 scale per output channel, w ~= w8 * scale[:, None].
`fp8` also quantizes each activation row (token) with its own scale and runs the GEMM through
`torch._scaled_mm` (FP8 matrix units on Ada/Hopper; a reference kernel on the CPU); the two
per-row scales are exact to apply after the integer-like product, so W8A8 costs two roundings.
Where the kernel refuses row-wise scales (the CPU kernel of some torch builds, large-K GEMMs on
Hopper before CUDA 13) it runs with unit per-tensor scales and the same scales are applied to its
fp32 product (`gemm_support`, model.loading.quantization's rules); where it has none, weight-only.
`fp8-weight-only` dequantizes the weight to the activation dtype for each call and uses F.linear.

Loading never holds the bf16 model: `Fp8Quantizer` is handed each tensor as it arrives from the
checkpoint (model.loading.checkpoint.load_streaming), merges that layer's LoRA updates into it, and turns
it into (w8, scale) at once; only one bf16 tensor is alive at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from ditfleet.model.loading.folder import WeightsError
from ditfleet.model.loading.quantization import (
    FP8_GEMM_MULTIPLE,
    check_fp8_device,
    check_quantization,
    fp8_keep,
    keeps_load_dtype,
    layer_scale_kind,
    rowwise_max_k,
)
from ditfleet.model.settings import DEFAULT_PIPELINE, Quantization

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rows quantized at a time: bounds the fp32 copy to ~12 MB however wide the layer, so that
# loading holds little beyond the one checkpoint tensor in flight (host RSS, bench/load_rss.py).
_ROWS_PER_CHUNK = 256
_TINY = 1e-12  # an all-zero row keeps a finite scale
# The layers a quantization keeps in the load dtype unless told otherwise: the default layer set's.
DEFAULT_KEEP = fp8_keep(DEFAULT_PIPELINE.fp8_layers)


def check_device(mode: Quantization, device: torch.device | str) -> None:
    """QuantizationError when `mode` cannot run on `device` (fp8 on a GPU without FP8 units);
    reads the device's properties only, before any weight or activation is placed there."""
    device = torch.device(device)
    capability, name = None, ""
    if device.type == "cuda" and check_quantization(mode) == "fp8":
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    check_fp8_device(mode, device.type, capability, name)
    if mode == "fp8":
        gemm_support(device)  # decided now, in eager, before anything compiles a call


# -- what this device's _scaled_mm takes ------------------------------------------------------------

# The kernel every fp8 GEMM calls (a module attribute, so that a test can stand a refusing one in).
_KERNEL = torch._scaled_mm
# Per device ("cpu", "cuda:0"): (the best scale kind its kernel takes, the largest K it takes
# row-wise or None). Filled once per device, in eager (check_device, or a layer's first call).
_GEMM_SUPPORT: dict[str, tuple[str, int | None]] = {}
_REFUSED_MESSAGES = ("CUBLAS_STATUS_NOT_SUPPORTED", "only supports", "not supported")


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def probe_scaled_mm(device: torch.device | str, kernel=None) -> str:
    """Which scales `kernel` (torch._scaled_mm) takes on `device`, by calling it once on a 16x16
    GEMM: "rowwise", else "tensorwise" (unit per-tensor scales), else "weight-only"."""
    kernel = kernel or _KERNEL
    device = torch.device(device)
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    b = torch.ones(16, 16, device=device).to(FP8_DTYPE).t()
    rows, cols = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
    one = torch.ones((), device=device)
    try:
        kernel(a, b, scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16)
        return "rowwise"
    except (RuntimeError, NotImplementedError):
        pass
    try:
        kernel(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return "tensorwise"
    except (RuntimeError, NotImplementedError):
        return "weight-only"


def gemm_support(device: torch.device | str, kernel=None) -> tuple[str, int | None]:
    """(scale kind, largest row-wise K) of `device`, decided once: on the CPU by probing the
    kernel (torch 2.11's CPU kernel takes per-tensor scales only, 2.13's row-wise too); on CUDA
    from the build's CUDA version and the GPU (model.loading.quantization.rowwise_max_k)."""
    key = _device_key(device)
    found = _GEMM_SUPPORT.get(key)
    if found is None:
        dev = torch.device(key)
        if dev.type == "cuda":
            capability = torch.cuda.get_device_capability(dev)
            found = ("rowwise", rowwise_max_k(torch.version.cuda, capability))
        else:
            found = (probe_scaled_mm(dev, kernel), None)
        _GEMM_SUPPORT[key] = found
    return found


def _known_above_one(rows: int | torch.SymInt) -> bool:
    """Whether a GEMM's row count is >= 2 from the shapes alone, without a guard (a static size,
    or a symbolic one times a static size >= 2)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(rows >= 2))


def _refused(error: RuntimeError) -> bool:
    return any(m in str(error) for m in _REFUSED_MESSAGES)


def check_checkpoint_dtypes(tensors: dict, where: str) -> None:
    """Refuse a checkpoint that already holds FP8 tensors, by name, before any weight is read.

    tensors: name -> model.loading.checkpoint.TensorEntry. Cast to bf16 without their scales, FP8 weights
    would load as silently wrong numbers; ditfleet quantizes the bf16 checkpoint at load instead."""
    fp8 = sorted(k for k, e in tensors.items() if e.dtype.startswith("F8"))
    if not fp8:
        return
    scales = {k for k in tensors if k.endswith(("weight_scale", "scale_weight", "weight_scale_inv"))}
    unscaled = [k for k in fp8 if not any(s.startswith(k.rpartition(".")[0] + ".") for s in scales)]
    if unscaled:
        raise WeightsError(
            f"{where}: {len(fp8)} tensors are stored in FP8 and {len(unscaled)} of them have no scale "
            f"tensor next to them (e.g. {unscaled[:3]}): the scales are missing, so these weights cannot "
            "be loaded. Use the bf16 checkpoint with model.quantization: fp8 (or fp8-weight-only)."
        )
    raise WeightsError(
        f"{where}: a pre-quantized FP8 checkpoint ({len(fp8)} FP8 tensors, e.g. {fp8[:3]}) is not "
        "supported: load the bf16 checkpoint with model.quantization: fp8 (or fp8-weight-only), which "
        "quantizes it while it streams in."
    )


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (w8 float8_e4m3fn (out, in), scale fp32 (out,)), per output channel.

    Computed in fp32 rows at a time on the weight's device; w8 * scale[:, None] ~= weight."""
    out = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = weight[lo : lo + _ROWS_PER_CHUNK].to(torch.float32, copy=True)  # divided in place below
        s = rows.abs().amax(dim=1).clamp_min(_TINY) / FP8_MAX
        out[lo : lo + _ROWS_PER_CHUNK] = rows.div_(s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[lo : lo + _ROWS_PER_CHUNK] = s
    return out, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) activations -> (x8 (M, K), scale fp32 (M, 1)), one scale per row (token).

    The scaling runs in the activation dtype: an fp32 copy of a (tokens x 4D) activation would
    cost more than the GEMM saves in memory, and bf16 carries more bits than e4m3 keeps."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_TINY)
    scale = amax / FP8_MAX
    x8 = (x * (1.0 / scale).to(x.dtype)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8, scale


# _scaled_mm's keyword for fast accumulation, passed only when on.
class _Accumulation(TypedDict, total=False):
    use_fast_accum: bool


class Fp8Linear(nn.Module):
    """A Linear whose weight is float8 e4m3 with per-output-channel fp32 scales.

    State-dict keys are the Linear's (`weight`, `bias`) plus `weight_scale`, so hooks, LoRA
    matching by module name and the diffusers names all still hold. Called as a module, like the
    nn.Linear it replaces. `mode`: "fp8" (W8A8 through torch._scaled_mm) or "fp8-weight-only".
    """

    weight_scale: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        mode: Quantization = "fp8",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if check_quantization(mode) == "none":
            raise ValueError("Fp8Linear: mode must be 'fp8' or 'fp8-weight-only'")
        self.in_features, self.out_features = in_features, out_features
        self.mode = mode
        # torch._scaled_mm needs both dims in multiples of 16; other layers run weight-only.
        self.scaled_mm = (
            mode == "fp8" and in_features % FP8_GEMM_MULTIPLE == 0 and out_features % FP8_GEMM_MULTIPLE == 0
        )
        # _scaled_mm's use_fast_accum (Hopper: faster, fewer accumulation bits); off by default.
        self.fast_accum = False
        w = torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: Quantization) -> Fp8Linear:
        """Quantize a loaded nn.Linear (the load path quantizes while streaming instead)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, "meta")
        w8, scale = quantize_weight(w.detach())
        layer.weight = nn.Parameter(w8, requires_grad=False)
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as `dtype` (out, in): w8 * scale, rounded once."""
        return self.weight.to(dtype) * self.weight_scale.to(dtype)[:, None]

    def scale_kind(self, device: torch.device) -> str:
        """How this layer's GEMM runs on `device`: FP8_SCALE_KINDS (model.loading.quantization)."""
        if not self.scaled_mm:
            return "weight-only"
        support = _GEMM_SUPPORT.get(str(device))
        if support is None:
            # Traced before any eager call decided it: per-tensor scales, which every build takes.
            support = ("tensorwise", None) if torch.compiler.is_compiling() else gemm_support(device)
        return layer_scale_kind(support[0], self.in_features, support[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.scale_kind(x.device)
        if kind == "weight-only":
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        lead = x.shape[:-1]
        x8, x_scale = quantize_rows(x.reshape(-1, self.in_features))
        rows = x8.shape[0]
        if torch.compiler.is_compiling() and not _known_above_one(rows):
            # _scaled_mm's shape check asks whether the (M, 1) activation scale is one value; for
            # an M that may be 1 (batch x text length: a one-token prompt at batch 1) that guard
            # would recompile the graph for it. One spare row makes M >= 2 provably; rows are
            # quantized and multiplied independently, so it changes nothing. The image stream
            # needs none: its M is batch x a static image length >= 2, the shape hint that
            # settles the check without a guard, so its (large) activation is not copied.
            x8, x_scale = torch.cat([x8, x8[:1]]), torch.cat([x_scale, x_scale[:1]])
        if kind == "rowwise":
            try:
                y = self._rowwise(x8, x_scale, x.dtype)[:rows]
            except RuntimeError as e:
                if torch.compiler.is_compiling() or not _refused(e):
                    raise
                y = self._refused_rowwise(x8, x_scale, x.dtype, e)[:rows]
        else:
            y = self._tensorwise(x8, x_scale, x.dtype)[:rows]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _rowwise(self, x8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # weight (out, in) row-major: its transpose is the column-major (in, out) operand
        # _scaled_mm requires; the scales are (M, 1) and (1, out): row-wise on both sides.
        return _KERNEL(
            x8,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale[None, :],
            out_dtype=dtype,
            **self._accum(),
        )

    def _accum(self) -> _Accumulation:
        return {"use_fast_accum": True} if self.fast_accum else {}

    def _tensorwise(self, x8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        one = torch.ones((), dtype=torch.float32, device=x8.device)
        y = _KERNEL(x8, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, **self._accum())
        return (y * x_scale * self.weight_scale[None, :]).to(dtype)

    def _refused_rowwise(
        self, x8: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, error: RuntimeError
    ) -> torch.Tensor:
        """The kernel refused this row-wise shape at run time (a build the rules do not know):
        the device takes row-wise scales only below this K from now on, and this call runs
        tensorwise."""
        import warnings

        key = str(x8.device)
        kind, max_k = _GEMM_SUPPORT.get(key, ("rowwise", None))
        _GEMM_SUPPORT[key] = (kind, min(max_k or self.in_features, self.in_features - 1))
        warnings.warn(
            f"fp8 GEMM with K={self.in_features} on {key}: the kernel refused row-wise scales "
            f"({str(error).splitlines()[0][:200]}); layers with K >= {self.in_features} run with "
            "per-tensor scales on this device from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return self._tensorwise(x8, x_scale, dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode}"
        )


def set_fast_accum(model: nn.Module, on: bool) -> int:
    """Turn _scaled_mm's fast accumulation on or off in every Fp8Linear of `model`; how many."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.fast_accum = bool(on)
    return len(layers)


def runs_scaled_gemms(model: nn.Module) -> bool:
    """Whether any layer of `model` runs its GEMM through torch._scaled_mm (FP8 activations)."""
    return any(isinstance(m, Fp8Linear) and m.scaled_mm for m in model.modules())


def _quantized_linears(model: nn.Module, keep: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The nn.Linear modules of `model` that a quantization replaces (all but `keep`), by name."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not keeps_load_dtype(name, tuple(keep))
    ]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class Fp8Quantizer:
    """Quantizes a DiT while load_streaming fills it, tensor by tensor.

    prepare(model): replaces the chosen nn.Linear modules of the meta-device model by meta
      Fp8Linear (same names); call after the checkpoint's keys were checked against the model.
    __call__(key, tensor): the state-dict entries to assign for one checkpoint tensor already in
      the load dtype on the load device: a quantized layer's weight becomes `weight` (fp8) and
      `weight_scale`, after the layer's LoRA updates are merged into it (merge, then quantize);
      every other tensor passes through.
    updates: LoRA layer updates (model.qwen_image.lora.LayerUpdate); those of quantized layers are merged
      here, `unmerged` holds the rest for model.qwen_image.lora.merge_updates afterwards.
    """

    def __init__(
        self, mode: Quantization, updates: Iterable = (), keep: Sequence[str] = DEFAULT_KEEP
    ) -> None:
        if check_quantization(mode) == "none":
            raise ValueError("Fp8Quantizer: mode 'none' quantizes nothing; load without a quantizer")
        self.mode, self.keep = mode, tuple(keep)
        self._updates = list(updates)
        self.names: set[str] = set()
        self.unmerged: list = self._updates

    def prepare(self, model: nn.Module) -> None:
        linears = _quantized_linears(model, self.keep)
        for name, lin in linears:
            empty = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, self.mode, "meta")
            _set_module(model, name, empty)
        self.names = {name for name, _ in linears}
        self.unmerged = [u for u in self._updates if u.module not in self.names]

    def __call__(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        module, _, param = key.rpartition(".")
        if module not in self.names:
            return [(key, tensor)]
        from ditfleet.model.qwen_image.lora import (
            merge_into,  # the same arithmetic as merging into a loaded model
        )

        mine = [u for u in self._updates if u.module == module]
        if param == "bias":
            for u in mine:
                merge_into(None, tensor, u)
            return [(key, tensor)]
        for u in mine:
            merge_into(tensor, None, u)
        w8, scale = quantize_weight(tensor)
        return [(key, w8), (f"{module}.weight_scale", scale)]


@torch.no_grad()
def quantize_model(model: nn.Module, mode: Quantization, keep: Sequence[str] = DEFAULT_KEEP) -> nn.Module:
    """Quantize an already loaded model in place (the self-test, tests, benches; loading quantizes
    while streaming instead, without a full-precision copy). keep: the patterns of the layers left
    as they are (model.loading.quantization.fp8_keep of a layer set; the default set's)."""
    for name, linear in _quantized_linears(model, keep):
        _set_module(model, name, Fp8Linear.from_linear(linear, mode))
    return model
