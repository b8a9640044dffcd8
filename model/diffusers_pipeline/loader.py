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
from ditfleet.model.diffusers_pipeline.index import (
    check_runnable,
    pipeline_max_sources,
    pipeline_task,
    read_index,
)
from ditfleet.model.family_types import EDIT
from ditfleet.model.generation.pipeline import Generation, Sampling
from ditfleet.model.loading.folder import WeightsError
from ditfleet.model.loading.folder import model_revision as content_revision
from ditfleet.model.loading.lora_spec import LoraSpec
from ditfleet.model.settings import DEFAULT_PIPELINE, PipelineSettings

# A source image as the worker hands it: a decoded RGB PIL.Image.Image (PIL is diffusers' own
# dependency; model/ does not import it).
SourceImage = Any


@dataclass(frozen=True)
class _Call:
    """The requests of one pipeline call, in order."""

    prompts: list[str]
    negatives: list[str | None] | None
    seeds: list[int]
    sources: list[list[SourceImage]] | None

    def padded(self, size: int) -> _Call:
        """Padded to `size` with copies of the last request (its images are dropped)."""
        pad = size - len(self.prompts)
        if pad <= 0:
            return self
        negatives = None if self.negatives is None else self.negatives + self.negatives[-1:] * pad
        sources = None if self.sources is None else self.sources + self.sources[-1:] * pad
        return _Call(
            self.prompts + self.prompts[-1:] * pad, negatives, self.seeds + self.seeds[-1:] * pad, sources
        )


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
        sources: Sequence[Sequence[SourceImage]] | None = None,
    ) -> dict[str, Any]:
        """The pipeline encodes its own text (and sees its own source images) inside its call:
        this only carries the texts, the text length and an edit's sources (one list per prompt,
        decoded RGB, in the row's column order) there; resizing them is the pipeline's own."""
        if sources is not None and len(sources) != len(prompts):
            raise ValueError(f"{len(sources)} source lists for {len(prompts)} prompts: one list per prompt")
        # The last guard: the job's validation refuses such rows before any work (RowConfig.max_sources).
        most = pipeline_max_sources(self.family.class_name)
        for i, row in enumerate(sources or ()):
            if not row or (most is not None and len(row) > most):
                raise ValueError(
                    f"sources[{i}]: {len(row)} source images; {self.family.class_name} takes "
                    f"{'one or more' if most is None else f'at most {most}'} per prompt"
                )
        return {
            "prompt": list(prompts),
            "negative_prompt": None if negative_prompts is None else list(negative_prompts),
            "max_sequence_length": max_sequence_length,
            "sources": None if sources is None else [list(s) for s in sources],
        }

    @torch.no_grad()
    def run(self, inputs: dict[str, Any], sampling: Sampling) -> Generation:
        """One batch: images (B, 3, H, W) in [0, 1], in the order of `sampling.seeds`. Images
        with different guidance scales run as separate calls (the pipelines take one scale); an
        edit whose row has several sources runs alone (the pipeline takes them as one list of
        references), so each row's call is the same whichever rows share its batch."""
        prompts, negatives = inputs["prompt"], inputs.get("negative_prompt")
        sources: list[list[SourceImage]] | None = inputs.get("sources")
        n = len(prompts)
        scales = sampling.true_cfg_scale
        scale_list = list(scales) if isinstance(scales, Sequence) else [float(scales)] * n
        # Calls group by scale, and a row with several sources is its own group.
        groups: dict[tuple[float, int], list[int]] = {}
        for i in range(n):
            several = sources is not None and len(sources[i]) > 1
            groups.setdefault((scale_list[i], i if several else -1), []).append(i)
        images: list[torch.Tensor | None] = [None] * n
        for (scale, alone), idx in groups.items():
            for start in range(0, len(idx), self.batch_size):
                part = idx[start : start + self.batch_size]
                call = _Call(
                    [prompts[i] for i in part],
                    None if negatives is None else [negatives[i] for i in part],
                    [sampling.seeds[i] for i in part],
                    None if sources is None else [sources[i] for i in part],
                )
                out = self._call(
                    call, sampling.height, sampling.width, sampling.steps, scale,
                    inputs.get("max_sequence_length"), pad=alone < 0,
                )  # fmt: skip
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
        max_sequence_length: int | None = None,
        sources: Sequence[Sequence[SourceImage]] | None = None,
    ) -> torch.Tensor:
        """What compile.warmup calls (with encode_guidance's inputs spelled out): `run`. An edit
        pipeline warmed without sources gets a mid-grey one per prompt at the bucket's size (a
        tensor in [0, 1], which diffusers' image processors take): the pipeline resizes every
        source to the output size, so a request's shapes are the warm-up's."""
        text_length = (
            self.settings.max_sequence_length if max_sequence_length is None else max_sequence_length
        )
        if sources is None and pipeline_task(self.family.class_name, self.call_parameters) == EDIT:
            grey = torch.full((3, height, width), 0.5)
            sources = [[grey] for _ in prompt]
        inputs = self.encode_guidance(prompt, negative_prompt, true_cfg_scale, text_length, sources)
        return self.run(inputs, Sampling(height, width, steps, list(seeds), true_cfg_scale)).images

    def _call(
        self,
        call: _Call,
        height: int,
        width: int,
        steps: int,
        guidance: float,
        max_sequence_length: int | None,
        pad: bool = True,
    ) -> torch.Tensor:
        real = len(call.prompts)
        # Padded to the actor's batch size with copies of the last request (see the module doc).
        call = call.padded(self.batch_size) if pad else call
        kwargs: dict[str, Any] = {
            "prompt": call.prompts,
            "height": height,
            "width": width,
            "num_inference_steps": steps,
            "generator": [torch.Generator("cpu").manual_seed(int(s)) for s in call.seeds],
            "output_type": "pt",
        }
        negatives = call.negatives if "negative_prompt" in self.call_parameters else None
        if "guidance_scale" not in self.call_parameters and "true_cfg_scale" in self.call_parameters:
            # A pipeline whose only scale is true CFG (Qwen-Image 2.1): on with a negative text,
            # which it needs present (" " where the row's is empty), as in the native family.
            kwargs["true_cfg_scale"] = guidance
            if negatives is not None:
                kwargs["negative_prompt"] = [x or " " for x in negatives]
        else:
            if "guidance_scale" in self.call_parameters:
                kwargs["guidance_scale"] = guidance
            if negatives is not None and any(negatives):
                kwargs["negative_prompt"] = [x or "" for x in negatives]
        if max_sequence_length is not None and "max_sequence_length" in self.call_parameters:
            kwargs["max_sequence_length"] = max_sequence_length
        if call.sources is not None:
            # One image per prompt as a batch; a row's several references as one list (run alone).
            kwargs["image"] = [s[0] for s in call.sources] if pad else call.sources[0]
        self.check_fits(height, width)
        measuring = self.device.type == "cuda"
        if measuring:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        images = self.pipeline(**kwargs).images  # (B, 3, H, W) float in [0, 1]
        if measuring:
            per_image = math.ceil((torch.cuda.max_memory_allocated(self.device) - base) / len(call.prompts))
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
    the GPU only while it runs: the least GPU memory, the transformer's weights cross the bus every
    batch); "cpu" keeps the text encoders on the CPU and runs them there, their embeddings moved to
    `device` (text_encoders_on_cpu: the transformer and VAE stay put, for 24/48 GB GPUs beside a
    T5-XXL); "gpu" keeps the whole pipeline on `device`."""
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
    on_cpu = text_encoder == "cpu" and device.type != "cpu"
    if text_encoder == "offload" and device.type == "cuda" and hasattr(pipeline, "enable_model_cpu_offload"):
        pipeline.enable_model_cpu_offload(device=device)
    else:
        pipeline.to(device)
        if on_cpu:
            text_encoders_on_cpu(pipeline, device)
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
        # On the GPU: every component's weights, but the text encoders' where they stay on the CPU.
        weight_bytes=sum(
            size
            for name, size in parameter_bytes(root, info).items()
            if not (on_cpu and name.startswith("text_encoder"))
        ),
    )


def text_encoders_on_cpu(pipeline: Any, device: torch.device) -> None:
    """The pipeline's text encoders (its components named text_encoder*) on the CPU, run there:
    their inputs come to the CPU and their outputs go to `device`, where the pipeline's own code
    (which hands them token ids on its execution device) expects them. diffusers reports the
    pipeline's device as the accelerator its other components are on (DiffusionPipeline.device)."""
    for name, module in pipeline.components.items():
        if name.startswith("text_encoder") and isinstance(module, torch.nn.Module):
            module.to("cpu")
            module.register_forward_pre_hook(
                lambda _m, args, kwargs: _moved((args, kwargs), "cpu"), with_kwargs=True
            )
            module.register_forward_hook(lambda _m, _args, out: _moved(out, device))


def _moved(value: Any, device: torch.device | str) -> Any:
    """Every tensor in `value` (tuples, lists, dicts and transformers' ModelOutput) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):  # ModelOutput is an OrderedDict whose items are its attributes too
        for key in list(value):
            value[key] = _moved(value[key], device)
        return value
    return value
