"""The memory plan of one bucket: weights per component plus each phase's activation peak, with
the CUDA reserve and fragmentation, against the memory of a GPU.

The shapes are the family's (`ModelMemory`, which a family's memory formula builds from a
model's configs); this module holds no family's configs or formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ditfleet.model.family_types import Size, SourceSizes
from ditfleet.model.loading.quantization import check_quantization
from ditfleet.model.settings import DEFAULT_PIPELINE, MAX_SEQUENCE_LENGTH, Fp8Layers, Quantization

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GB = 10**9  # GPU memory is quoted in decimal GB (an "80 GB" card holds at least 80e9 bytes)
GiB = 2**30
# Outside torch's tensors: the CUDA context, cuBLAS/cuDNN handles and workspaces.
CUDA_RESERVE = int(1.5 * GiB)
# The caching allocator rounds blocks up and fragments under changing shapes.
FRAGMENTATION = 1.10
TEXT_ENCODER_PLACEMENTS = ("gpu", "cpu", "offload")


class ModelMemory(Protocol):
    """One model's memory as its family's formula gives it, from its configs alone (a family's
    `memory.from_dir` / `from_configs`, model.family): what the plan asks of the shapes. The plan
    adds what every family shares: the phases, the CUDA reserve, fragmentation, the text
    encoder's placement. Units: bytes; `e` is the element size of the plan's dtype."""

    @property
    def name(self) -> str: ...

    def params(self) -> dict[str, int]:
        """Parameters per component: "transformer", "vae" and, when it has one, "text_encoder"."""
        ...

    def dit_weight_bytes(
        self, e: int, quantization: Quantization = "none", fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers
    ) -> int:
        """The DiT's weights as loaded, under a quantization (model.quantization) too."""
        ...

    def dit_activation_bytes(
        self, batch: int, height: int, width: int, text_len: int, e: int, *, attention: str, device: str
    ) -> int:
        """Peak above the weights of one DiT forward of `batch` sequences ("fused" or "math" attention)."""
        ...

    def fp8_transient_bytes(
        self, quantization: Quantization, batch: int, height: int, width: int, text_len: int, e: int
    ) -> int:
        """What the quantized DiT's GEMMs hold beyond that forward's peak (0 unquantized)."""
        ...

    def vae_decode_activation_bytes(self, batch: int, height: int, width: int, e: int) -> int: ...

    def for_sources(self, sources: SourceSizes) -> ModelMemory:
        """The same model for an edit whose rows carry these sources ((width, height) each): the
        DiT's figures above count their tokens, and `source_encode_activation_bytes` their encode."""
        ...

    def source_encode_activation_bytes(self, batch: int, e: int) -> int:
        """The sources of `batch` rows through the VAE's encoder (0 without sources)."""
        ...

    def text_encode_activation_bytes(self, text_len: int, e: int) -> int | None:
        """Encoding one prompt of `text_len` tokens; None without a text encoder."""
        ...

    def vqa_activation_bytes(self, height: int, width: int, text_len: int, e: int) -> int | None:
        """Scoring one image with vqa on its text encoder; None when its encoder cannot."""
        ...

    def modulation_table_bytes(self, steps: int, e: int) -> int:
        """The 'table' modulation cache of schedules `steps` steps long in all."""
        ...

    def image_tensor_bytes(self, height: int, width: int, e: int) -> int:
        """One image-stream tensor of one image: the unit a step cache keeps."""
        ...


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on the GPU, phase by phase, for one image size, batch and text-encoder placement.

    Phases: "encode" (prompts through the text encoder), "denoise" (the DiT forward), "decode"
    (the VAE), for an edit "source_encode" (its sources through the VAE's encoder) and, with the vqa scorer and the text encoder on the GPU, "score" (one image through
    the text encoder, model.quality.vqa). `peak` is the largest phase. With `offload`, the text encoder comes onto
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
    sources: tuple[Size, ...] = ()  # an edit's sources per image, (width, height) each

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
            "sources": [f"{w}x{h}" for w, h in self.sources],
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
        n = len(self.sources)
        edit = f" with {n} source{'s' * (n > 1)} each" if n else ""
        return (
            f"{self.width}x{self.height} x{self.batch}{edit} {self.dtype}{dit}, {where}: "
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
    sources: SourceSizes = (),
) -> MemoryPlan:
    """The memory plan of generating `batch` images of height x width, run as `run` says.

    step_cache_tensors: image-stream tensors (N x D per image) a step cache keeps per CFG branch
      through the whole schedule (model.step_cache_config.StepCacheConfig.kept_tensors); 0: none.
    sources: an edit's source images per row, (width, height) each: their tokens in every DiT
      forward and their VAE encode (a phase of its own), as the family sizes them.
    """
    run.check()
    if batch < 1 or height % 16 or width % 16 or height < 16 or width < 16:
        raise ValueError(
            f"need batch >= 1 and sizes that are multiples of 16, got {batch} x {width}x{height}"
        )
    e = DTYPE_BYTES[run.dtype]
    if sources:
        model = model.for_sources(sources)
    weights = {k: v * e for k, v in model.params().items()}
    weights["transformer"] = model.dit_weight_bytes(e, check_quantization(run.quantization), run.fp8_layers)
    acts = _activations(model, run, batch, height, width, e)
    if sources:  # encoded with the batch's prompts, before the first step
        acts["source_encode"] = model.source_encode_activation_bytes(batch, e)
    extra: dict[str, int] = {}
    if run.modulation_table_steps:
        extra["modulation_table"] = model.modulation_table_bytes(sum(run.modulation_table_steps), e)
    if step_cache_tensors:
        branches = 1 if run.cfg == "off" else 2
        extra["step_cache"] = (
            step_cache_tensors * branches * batch * model.image_tensor_bytes(height, width, e)
        )
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
        sources=tuple(sources),
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
    if "source_encode" in acts:
        phases["source_encode"] = resident + te_resident + _fragmented(acts["source_encode"])
    if "encode" in acts and run.text_encoder != "cpu":
        encode = resident + te_w + _fragmented(acts["encode"])
        if run.text_encoder == "offload" and capacity is not None and encode > capacity:
            encode -= dit_w  # the DiT waits in host memory while the shard's prompts are encoded
            swapped = True
            host = max(host, te_w + dit_w)
        phases["encode"] = encode
    return phases, swapped, host


def _fragmented(nbytes: int) -> int:
    return int(nbytes * FRAGMENTATION)


def _activations(
    model: ModelMemory, run: Runtime, batch: int, height: int, width: int, e: int
) -> dict[str, int]:
    """Activation bytes of each phase: denoise (the FP8 GEMMs' transients included), decode,
    encode when the model has a text encoder, and score when vqa runs on the GPU's encoder."""
    dit_batch = 2 * batch if run.cfg == "batched" else batch
    vae_batch = min(run.vae_batch or batch, batch)
    args = (dit_batch, height, width, run.text_len, e)
    acts = {
        "denoise": model.dit_activation_bytes(*args, attention=run.attention, device=run.device)
        + model.fp8_transient_bytes(run.quantization, *args),
        "decode": model.vae_decode_activation_bytes(vae_batch, height, width, e),
    }
    encode = model.text_encode_activation_bytes(run.text_len, e)
    if encode is not None:
        acts["encode"] = encode
        score = model.vqa_activation_bytes(height, width, run.text_len, e)
        if run.vqa and score is not None and run.text_encoder == "gpu":
            acts["score"] = score
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
