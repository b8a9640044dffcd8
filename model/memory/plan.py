"""The memory plan of one bucket: weights per component plus each phase's activation peak, with
the CUDA reserve and fragmentation, against the memory of a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditfleet.model.loading.folder import read_config
from ditfleet.model.loading.quantization import check_quantization
from ditfleet.model.qwen_image.memory_activations import (
    dit_activation_bytes,
    image_tokens,
    text_encode_activation_bytes,
    vae_decode_activation_bytes,
    vae_encode_activation_bytes,
    vqa_activation_bytes,
)
from ditfleet.model.qwen_image.memory_params import (
    text_encoder_params,
    transformer_params,
    transformer_weight_bytes,
    vae_params,
)
from ditfleet.model.qwen_image.transformer_config import TransformerConfig
from ditfleet.model.qwen_image.vae_config import VAEConfig
from ditfleet.model.settings import DEFAULT_PIPELINE, MAX_SEQUENCE_LENGTH, Fp8Layers, Quantization

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GB = 10**9  # GPU memory is quoted in decimal GB (an "80 GB" card holds at least 80e9 bytes)
GiB = 2**30
# Outside torch's tensors: the CUDA context, cuBLAS/cuDNN handles and workspaces.
CUDA_RESERVE = int(1.5 * GiB)
# The caching allocator rounds blocks up and fragments under changing shapes.
FRAGMENTATION = 1.10
TEXT_ENCODER_PLACEMENTS = ("gpu", "cpu", "offload")
# Qwen-Image's prompt template: its 34 leading tokens are dropped, a few trail the prompt.
QWEN_TEMPLATE_TOKENS = 40


@dataclass(frozen=True)
class ModelMemory:
    """What sizes a model: its configs (text_encoder None when the folder has none)."""

    transformer: TransformerConfig
    vae: VAEConfig
    text_encoder: dict[str, Any] | None = None
    name: str = ""

    @classmethod
    def from_dir(cls, root: str | Path, name: str | None = None) -> ModelMemory:
        """Read `transformer/`, `vae/` (and `text_encoder/`) config.json; no weights."""
        root = Path(root)
        te_dir = root / "text_encoder"
        return cls.from_configs(
            read_config(root / "transformer"),
            read_config(root / "vae"),
            read_config(te_dir) if (te_dir / "config.json").is_file() else None,
            name=name or str(root),
            where=str(root),
        )

    @classmethod
    def from_configs(
        cls, transformer: dict, vae: dict, text_encoder: dict | None, name: str = "", where: str = ""
    ) -> ModelMemory:
        t_where, v_where = f"{where}/transformer/config.json", f"{where}/vae/config.json"
        te = dict(text_encoder) if text_encoder is not None else None
        model = cls(
            TransformerConfig.from_dict(transformer, where=t_where),
            VAEConfig.from_dict(vae, v_where),
            te,
            name,
        )
        if te is not None:
            try:
                text_encoder_params(te)
            except KeyError as e:
                raise ValueError(f"{where}/text_encoder/config.json: missing key {e}") from e
        return model

    def params(self) -> dict[str, int]:
        out = {"transformer": transformer_params(self.transformer), "vae": vae_params(self.vae)}
        if self.text_encoder is not None:
            out["text_encoder"] = text_encoder_params(self.text_encoder)
        return out


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on the GPU, phase by phase, for one image size, batch and text-encoder placement.

    Phases: "encode" (prompts through the text encoder), "denoise" (the DiT forward), "decode"
    (the VAE) and, with the vqa scorer and the text encoder on the GPU, "score" (one image through
    the text encoder, model.quality.vqa); for an edit model (`Runtime.sources`) "source_encode"
    (the sources through the VAE's encoder). `peak` is the largest phase. With `offload`, the text encoder comes onto
    the GPU only to encode a shard's prompts; when it cannot sit next to the DiT, the DiT waits
    in host memory meanwhile (`dit_swapped`).
    """

    model: str
    dtype: str
    width: int
    height: int
    batch: int
    text_encoder: str
    cfg: str
    vae_batch: int
    text_len: int
    weights: dict[str, int]  # component -> bytes (in the plan's dtype)
    phases: dict[str, int]  # phase -> peak bytes on the GPU (reserve and fragmentation included)
    activations: dict[str, int]  # phase -> activation bytes (before fragmentation)
    extra: dict[str, int] = field(default_factory=dict)  # e.g. the modulation table
    capacity: int | None = None  # bytes of the GPU, None: unknown
    dit_swapped: bool = False
    host: int = 0  # bytes kept in host memory (a CPU text encoder, a swapped DiT)
    device: str = "cuda"
    quantization: Quantization = "none"  # the DiT's weights (model.quantization)

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        gb = lambda b: round(b / GB, 2)  # noqa: E731
        return {
            "model": self.model,
            "bucket": f"{self.width}x{self.height}",
            "batch": self.batch,
            "dtype": self.dtype,
            "text_encoder": self.text_encoder,
            "cfg": self.cfg,
            "vae_batch": self.vae_batch,
            "text_len": self.text_len,
            "weights_gb": {k: gb(v) for k, v in self.weights.items()},
            "activations_gb": {k: gb(v) for k, v in self.activations.items()},
            "extra_gb": {k: gb(v) for k, v in self.extra.items()},
            "phases_gb": {k: gb(v) for k, v in self.phases.items()},
            "peak_gb": gb(self.peak),
            "peak_phase": self.peak_phase,
            "capacity_gb": None if self.capacity is None else gb(self.capacity),
            "fits": self.fits,
            "dit_swapped": self.dit_swapped,
            "host_gb": gb(self.host),
            "device": self.device,
            "quantization": self.quantization,
        }

    def describe(self) -> str:
        """One line: '1328x1328 x1 bf16, text encoder cpu: peak 43.1 GB (decode) of 48 GB: fits'."""
        gb = lambda b: f"{b / GB:.1f}"  # noqa: E731
        verdict = ""
        if self.capacity is not None:
            verdict = f" of {gb(self.capacity)} GB: " + ("fits" if self.fits else "DOES NOT FIT")
        swap = ", DiT waits in host memory while encoding" if self.dit_swapped else ""
        where = f"text encoder {self.text_encoder}" if self.device == "cuda" else "on the CPU"
        dit = f", DiT {self.quantization}" if self.quantization != "none" else ""
        return (
            f"{self.width}x{self.height} x{self.batch} {self.dtype}{dit}, {where}: "
            f"peak {gb(self.peak)} GB ({self.peak_phase}){verdict}{swap}"
        )


@dataclass(frozen=True)
class Runtime:
    """How a batch runs, all but its size, its step cache and the GPU's memory.

    cfg: "serial" (two DiT passes per step), "batched" (one pass of 2 x batch) or "off".
    vae_batch: images per VAE decode call (1 when the decode is compiled), None: the batch.
    text_len: the padded prompt length the DiT sees (the prompt-length bucket).
    modulation_table_steps: step counts of the schedules kept in "table" modulation-cache mode.
    device: "cuda" adds the CUDA context's reserve; "cpu" (an actor without a GPU) does not.
    quantization: the DiT's weights (model.quantization): FP8 stores its Linear weights in one
      byte each (40.9 -> 20.5 GB at Qwen-Image size) and adds the GEMMs' own transients.
    vqa: quality.scorers asks vqa of every image, one forward of the text encoder per image where
      the encoder sits: a phase of its own on the GPU when it sits there ("gpu"); with "cpu" or
      "offload" the score runs on the host and takes no GPU memory.
    sources: an edit model's source images per image, each its (width, height) at the VAE's
      source size (model.family.source_size): their latent tokens lengthen the DiT's image stream,
      the VAE keeps its encoder, and encoding them is a phase of its own ("source_encode"). Count
      the vision tokens Qwen2.5-VL gives them in text_len.
    """

    dtype: str = "bf16"
    text_encoder: str = "gpu"
    cfg: str = "serial"
    vae_batch: int | None = 1
    text_len: int = MAX_SEQUENCE_LENGTH
    modulation_table_steps: tuple[int, ...] = ()
    attention: str = "fused"
    device: str = "cuda"
    quantization: Quantization = "none"
    fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers  # which Linears the quantization stores in FP8
    vqa: bool = False
    sources: tuple[tuple[int, int], ...] = ()

    def check(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.text_encoder not in TEXT_ENCODER_PLACEMENTS:
            raise ValueError(
                f"text_encoder must be one of {TEXT_ENCODER_PLACEMENTS}, got {self.text_encoder!r}"
            )
        if self.cfg not in ("serial", "batched", "off"):
            raise ValueError(f"cfg must be serial, batched or off, got {self.cfg!r}")


def plan_memory(
    model: ModelMemory,
    *,
    height: int,
    width: int,
    batch: int,
    run: Runtime = Runtime(),
    gpu_memory_gb: float | None = None,
    step_cache_tensors: int = 0,
) -> MemoryPlan:
    """The memory plan of generating `batch` images of height x width, run as `run` says.

    step_cache_tensors: image-stream tensors (N x D per image) a step cache keeps per CFG branch
      through the whole schedule (model.step_cache_config.StepCacheConfig.kept_tensors); 0: none.
    """
    run.check()
    if batch < 1 or height % 16 or width % 16 or height < 16 or width < 16:
        raise ValueError(
            f"need batch >= 1 and sizes that are multiples of 16, got {batch} x {width}x{height}"
        )
    e = DTYPE_BYTES[run.dtype]
    weights = {k: v * e for k, v in model.params().items()}
    if run.sources:  # an edit model's VAE keeps its encoder
        weights["vae"] = vae_params(model.vae, with_encoder=True) * e
    weights["transformer"] = transformer_weight_bytes(
        model.transformer, e, check_quantization(run.quantization), run.fp8_layers
    )
    acts = _activations(model, run, batch, height, width, e)
    extra: dict[str, int] = {}
    if run.modulation_table_steps:
        D, layers = model.transformer.inner_dim, model.transformer.num_layers
        extra["modulation_table"] = sum(run.modulation_table_steps) * layers * 2 * 6 * D * e
    if step_cache_tensors:
        branches = 1 if run.cfg == "off" else 2
        N, D = image_tokens(height, width), model.transformer.inner_dim
        extra["step_cache"] = step_cache_tensors * branches * batch * N * D * e
    capacity = None if gpu_memory_gb is None else int(gpu_memory_gb * GB)
    phases, swapped, host = _phases(run, weights, acts, sum(extra.values()), capacity)
    return MemoryPlan(
        model=model.name,
        dtype=run.dtype,
        width=width,
        height=height,
        batch=batch,
        text_encoder=run.text_encoder,
        cfg=run.cfg,
        vae_batch=min(run.vae_batch or batch, batch),
        text_len=run.text_len,
        weights=weights,
        phases=phases,
        activations=acts,
        extra=extra,
        capacity=capacity,
        dit_swapped=swapped,
        host=host,
        device=run.device,
        quantization=run.quantization,
    )


def _phases(
    run: Runtime, weights: dict[str, int], acts: dict[str, int], carried: int, capacity: int | None
) -> tuple[dict[str, int], bool, int]:
    """(bytes on the GPU per phase, whether the DiT waits in host memory while encoding, bytes
    kept in host memory). `carried`: what stays resident beside the weights (the extras)."""
    dit_w, vae_w, te_w = weights["transformer"], weights["vae"], weights.get("text_encoder", 0)
    # Latents, velocities and embeddings of the batch while the VAE runs: small, but resident.
    resident = dit_w + vae_w + carried + (CUDA_RESERVE if run.device == "cuda" else 0)
    te_resident = te_w if run.text_encoder == "gpu" else 0
    phases = {
        "denoise": resident + te_resident + _fragmented(acts["denoise"]),
        "decode": resident + te_resident + _fragmented(acts["decode"]),
    }
    swapped = False
    host = te_w if run.text_encoder != "gpu" else 0
    if "score" in acts:  # after the decode, the batch's pixels only beside the weights
        phases["score"] = resident + te_resident + _fragmented(acts["score"])
    if "source_encode" in acts:  # an edit model's sources through the VAE's encoder
        phases["source_encode"] = resident + te_resident + _fragmented(acts["source_encode"])
    if "encode" in acts and run.text_encoder != "cpu":
        encode = resident + te_w + _fragmented(acts["encode"])
        if run.text_encoder == "offload" and capacity is not None and encode > capacity:
            encode -= dit_w  # the DiT waits in host memory while the shard's prompts are encoded
            swapped = True
            host = max(host, te_w + dit_w)
        phases["encode"] = encode
    return phases, swapped, host


def _fp8_transient(
    model: ModelMemory, run: Runtime, dit_batch: int, height: int, width: int, e: int, source_tokens: int = 0
) -> int:
    """What the FP8 GEMMs (model.qwen_image.fp8) hold beyond the bf16 forward's tensors at its peak (the MLP
    down-projection): `fp8` the scaled copy's FP8 codes of its 4D-wide input, one byte per element
    (the scaled copy itself takes the freed up-projection's place); `fp8-weight-only` the largest
    weight dequantized, and its cast, for the duration of one GEMM."""
    D = model.transformer.inner_dim
    if run.quantization == "fp8":
        tokens = max(image_tokens(height, width) + source_tokens, run.text_len)
        return dit_batch * tokens * 4 * D
    if run.quantization == "fp8-weight-only":
        return 2 * 4 * D * D * e
    return 0


def _fragmented(nbytes: int) -> int:
    return int(nbytes * FRAGMENTATION)


def _activations(
    model: ModelMemory, run: Runtime, batch: int, height: int, width: int, e: int
) -> dict[str, int]:
    """Activation bytes of each phase: denoise (the FP8 GEMMs' transients included), decode,
    encode when the model has a text encoder, and score when vqa runs on the GPU's encoder."""
    dit_batch = 2 * batch if run.cfg == "batched" else batch
    vae_batch = min(run.vae_batch or batch, batch)
    source_tokens = sum(image_tokens(h, w) for w, h in run.sources)
    acts = {
        "denoise": dit_activation_bytes(
            model.transformer,
            dit_batch,
            height,
            width,
            run.text_len,
            e,
            run.attention,
            run.device,
            source_tokens,
        )
        + _fp8_transient(model, run, dit_batch, height, width, e, source_tokens),
        "decode": vae_decode_activation_bytes(model.vae, vae_batch, height, width, e),
    }
    if run.sources:  # the i-th sources of the batch's rows are one encode
        acts["source_encode"] = max(
            vae_encode_activation_bytes(model.vae, batch, h, w, e) for w, h in run.sources
        )
    if model.text_encoder is not None:
        qwen = "vision_config" in model.text_encoder
        tokens = run.text_len + (QWEN_TEMPLATE_TOKENS if qwen else 0)
        acts["encode"] = text_encode_activation_bytes(model.text_encoder, tokens, e)
        if run.vqa and qwen and run.text_encoder == "gpu":
            acts["score"] = vqa_activation_bytes(model.text_encoder, height, width, run.text_len, e)
    return acts


def largest_batch(model: ModelMemory, gpu_memory_gb: float, limit: int = 1024, **kwargs: Any) -> int:
    """The largest batch (<= limit) whose plan fits `gpu_memory_gb`; 0 when not even 1 fits.
    kwargs: as for `plan_memory` (height and width required; `run`, `step_cache_tensors`)."""
    fits = lambda b: bool(plan_memory(model, batch=b, gpu_memory_gb=gpu_memory_gb, **kwargs).fits)  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, limit  # peak grows with the batch: bisect for the last batch that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
