"""A diffusers pipeline behind the interface the actor drives (workers.generate, compile.warmup).

    pipe = load_diffusers_pipeline(folder, device, dtype, settings, batch_size=4, loras=...)
    pipe.run(pipe.encode_guidance(prompts, negatives, scales, n), Sampling(h, w, steps, seeds, scales))

The pipeline owns its loop: ditfleet hands it prompts and one torch.Generator per image (on the
CPU, so the noise is the same on any device) and takes its images as float tensors. Every batch
runs at the actor's batch size: a shorter one is padded with copies of its last request, whose
images are dropped. Batched kernels compute each row alike only at one batch shape, so this is
what makes an image's bytes independent of which rows share its batch (a resume, a retry and the
gate give the bytes a first run gave), and it is also the one shape warm-up compiles.

diffusers is the `diffusers` extra: imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditfleet.model.diffusers_pipeline.family import DiffusersFamily, parameter_bytes
from ditfleet.model.diffusers_pipeline.index import check_runnable, read_index
from ditfleet.model.generation.pipeline import Generation, Sampling
from ditfleet.model.loading.folder import WeightsError
from ditfleet.model.loading.folder import model_revision as content_revision
from ditfleet.model.loading.lora_spec import LoraSpec
from ditfleet.model.settings import DEFAULT_PIPELINE, PipelineSettings


class DiffusersMemoryError(RuntimeError):
    """A batch whose measured memory does not fit this GPU; the message says what would."""


@dataclass
class DiffusersTextToImage:
    """The loaded diffusers pipeline, as workers.generate and compile.warmup call a pipeline."""

    pipeline: Any  # the diffusers DiffusionPipeline
    family: DiffusersFamily
    model_id: str
    model_revision: str
    device: torch.device
    dtype: torch.dtype
    settings: PipelineSettings
    call_parameters: tuple[str, ...]
    batch_size: int  # every batch runs at this size (padded)
    weight_bytes: int  # the checkpoint's parameters as stored (safetensors headers)
    # Activation bytes per image measured at each (height, width) on CUDA (warm-up measures each bucket).
    activations: dict[tuple[int, int], int] = field(default_factory=dict)

    # -- what compile/ and the actor read ----------------------------------------------------------

    @property
    def transformer(self) -> Any:
        return self.pipeline.transformer

    @property
    def vae(self) -> Any:
        return self.pipeline.vae

    @property
    def vae_dtype(self) -> torch.dtype:
        return self.pipeline.vae.dtype

    @property
    def text_encoder(self) -> Any:
        # Never None: warm-up then hands prompts to encode_guidance, as requests do.
        return getattr(self.pipeline, "text_encoder", None) or self.pipeline

    def prefill_modulation(self, height: int, width: int, steps: int) -> int:
        """The blocks' modulation table the actor fills per bucket at warm-up: a diffusers-run
        transformer has no modulation cache (docs/performance.md, what each family gets), so
        there is nothing to build: 0 entries, as a native pipeline in another cache mode."""
        return 0

    # -- the request path --------------------------------------------------------------------------

    def count_tokens(self, prompts: list[str], max_sequence_length: int) -> list[int] | None:
        return None  # the pipeline pads text to its own fixed length: batches keep input order

    def encode_guidance(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str | None] | None,
        true_cfg_scale: float | Sequence[float],
        max_sequence_length: int,
    ) -> dict[str, Any]:
        """The pipeline encodes its own text inside its call: this only carries the texts there."""
        return {
            "prompt": list(prompts),
            "negative_prompt": None if negative_prompts is None else list(negative_prompts),
        }

    @torch.no_grad()
    def run(self, inputs: dict[str, Any], sampling: Sampling) -> Generation:
        """One batch: images (B, 3, H, W) in [0, 1], in the order of `sampling.seeds`. Images
        with different guidance scales run as separate calls (the pipelines take one scale)."""
        prompts, negatives = inputs["prompt"], inputs.get("negative_prompt")
        n = len(prompts)
        scales = sampling.true_cfg_scale
        scale_list = list(scales) if isinstance(scales, Sequence) else [float(scales)] * n
        images: list[torch.Tensor | None] = [None] * n
        for scale in dict.fromkeys(scale_list):
            idx = [i for i in range(n) if scale_list[i] == scale]
            for start in range(0, len(idx), self.batch_size):
                part = idx[start : start + self.batch_size]
                out = self._call(
                    [prompts[i] for i in part],
                    None if negatives is None else [negatives[i] for i in part],
                    [sampling.seeds[i] for i in part],
                    sampling.height,
                    sampling.width,
                    sampling.steps,
                    scale,
                )
                for i, image in zip(part, out):
                    images[i] = image
        return Generation(torch.stack([im for im in images if im is not None]))

    def generate(
        self,
        prompt: Sequence[str],
        negative_prompt: Sequence[str | None] | None = None,
        *,
        height: int,
        width: int,
        steps: int,
        true_cfg_scale: float | Sequence[float] = 1.0,
        seeds: Sequence[int],
    ) -> torch.Tensor:
        """What compile.warmup calls: `run` with the sampling spelled out."""
        inputs = {"prompt": list(prompt), "negative_prompt": negative_prompt}
        return self.run(inputs, Sampling(height, width, steps, list(seeds), true_cfg_scale)).images

    def _call(
        self,
        prompts: list[str],
        negatives: list[str | None] | None,
        seeds: list[int],
        height: int,
        width: int,
        steps: int,
        guidance: float,
    ) -> torch.Tensor:
        real = len(prompts)
        pad = self.batch_size - real
        prompts, seeds = prompts + prompts[-1:] * pad, seeds + seeds[-1:] * pad
        kwargs: dict[str, Any] = {
            "prompt": prompts,
            "height": height,
            "width": width,
            "num_inference_steps": steps,
            "generator": [torch.Generator("cpu").manual_seed(int(s)) for s in seeds],
            "output_type": "pt",
        }
        if "guidance_scale" in self.call_parameters:
            kwargs["guidance_scale"] = guidance
        if negatives is not None and "negative_prompt" in self.call_parameters and any(negatives):
            kwargs["negative_prompt"] = [x or "" for x in negatives + negatives[-1:] * pad]
        self.check_fits(height, width)
        measuring = self.device.type == "cuda"
        if measuring:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        images = self.pipeline(**kwargs).images  # (B, 3, H, W) float in [0, 1]
        if measuring:
            per_image = math.ceil((torch.cuda.max_memory_allocated(self.device) - base) / self.batch_size)
            key = (height, width)
            self.activations[key] = max(self.activations.get(key, 0), per_image)
        return images[:real]

    def check_fits(self, height: int, width: int) -> None:
        """Before a batch: the weights plus the activations measured at this size (warm-up ran it)
        must fit this GPU; refused naming both, rather than failing with an out-of-memory error."""
        measured = self.activations.get((height, width))
        if self.device.type != "cuda" or measured is None:
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        need = self.weight_bytes + measured * self.batch_size
        if need > total:
            fits = max(0, (total - self.weight_bytes) // max(measured, 1))
            raise DiffusersMemoryError(
                f"{self.model_id}: batch {self.batch_size} at {width}x{height} needs {need / 2**30:.1f} GiB "
                f"(weights {self.weight_bytes / 2**30:.1f} GiB + {measured / 2**30:.2f} GiB per image, measured at "
                f"warm-up) of this GPU's {total / 2**30:.1f} GiB; set workers.batch_size {fits} or less"
                + ("" if fits else ", or model.text_encoder: offload")
            )


def load_diffusers_pipeline(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    settings: PipelineSettings = DEFAULT_PIPELINE,
    *,
    model_id: str | None = None,
    model_revision: str | None = None,
    batch_size: int = 1,
    loras: Sequence[LoraSpec] = (),
    text_encoder: str = "gpu",
) -> DiffusersTextToImage:
    """The checkpoint at `path` through its own diffusers pipeline class, on `device`.

    loras: through diffusers' loader (`load_lora_weights`), fused at their scales.
    text_encoder: "offload" on CUDA uses the pipeline's `enable_model_cpu_offload` (each model on
    the GPU only while it runs); "gpu" and "cpu" keep the whole pipeline on `device` (the text
    encoders are the pipeline's own and run where it runs)."""
    root = Path(path)
    info = read_index(root)
    if info is None:
        raise WeightsError(
            f"{root}: no model_index.json; a diffusers checkpoint names its pipeline class there"
        )
    params = check_runnable(info)
    absent = [
        name for name, (lib, cls) in info.components.items() if lib and cls and not (root / name).is_dir()
    ]
    if absent:
        raise WeightsError(
            f"{info.where}: {info.class_name} names components {absent}, which {root} lacks. "
            "Point model.path at the whole checkpoint (every folder its model_index.json names)."
        )
    import diffusers

    cls = getattr(diffusers, info.class_name)
    device = torch.device(device)
    pipeline = cls.from_pretrained(str(root), torch_dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    if loras:
        names = [f"ditfleet_{i}" for i in range(len(loras))]
        for spec, name in zip(loras, names):
            pipeline.load_lora_weights(spec.path, adapter_name=name)
        pipeline.set_adapters(names, adapter_weights=[spec.scale for spec in loras])
        pipeline.fuse_lora(adapter_names=names)
        pipeline.unload_lora_weights()
    if text_encoder == "offload" and device.type == "cuda" and hasattr(pipeline, "enable_model_cpu_offload"):
        pipeline.enable_model_cpu_offload(device=device)
    else:
        pipeline.to(device)
    return DiffusersTextToImage(
        pipeline=pipeline,
        family=DiffusersFamily(info.class_name),
        model_id=model_id or str(path),
        model_revision=model_revision or content_revision(root),
        device=device,
        dtype=dtype,
        settings=settings,
        call_parameters=params,
        batch_size=max(1, batch_size),
        weight_bytes=sum(parameter_bytes(root, info).values()),
    )
