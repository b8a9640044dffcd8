"""The Qwen-Image family's `load_pipeline`: a diffusers-layout model directory (or "tiny") ->
TextToImagePipeline (model.family.load_pipeline picks the family, then calls this).

The directory holds `transformer/`, `vae/`, `scheduler/` and optionally `text_encoder/` and
`tokenizer/`, each with its config and safetensors. Nothing is ever downloaded here: remote
weights are staged to a local directory by the worker before this is called.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ditfleet.model.generation.components import TextEncoder
from ditfleet.model.generation.pipeline import TextToImagePipeline
from ditfleet.model.generation.scheduler import SchedulerConfig
from ditfleet.model.loading.checkpoint import Checkpoint, load_streaming
from ditfleet.model.loading.folder import (  # noqa: F401 - re-exported: the folder checks are torch-free
    REQUIRED_COMPONENTS,
    TINY_MODEL_DIR,
    model_dir_layout,
    model_revision,
    read_model_index,
    text_encoder_kind,
)
from ditfleet.model.loading.quantization import check_quantization, fp8_keep, quantized_revision
from ditfleet.model.loading.weights import WeightsError, on_meta, read_config
from ditfleet.model.qwen_image.edit import edit_style_of
from ditfleet.model.qwen_image.edit_sources import QwenImageEdit
from ditfleet.model.qwen_image.fp8 import Fp8Quantizer, check_checkpoint_dtypes, check_device
from ditfleet.model.qwen_image.lora import (
    LoraSpec,
    adapters_revision,
    merge_updates,
    plan_updates,
    read_lora,
)
from ditfleet.model.qwen_image.text_encoder import QwenVLTextEncoder
from ditfleet.model.qwen_image.transformer import QwenImageTransformer, TransformerConfig, prepare_inputs
from ditfleet.model.qwen_image.vae import load_vae
from ditfleet.model.settings import DEFAULT_PIPELINE, Fp8Layers, PipelineSettings, Quantization


def prepare_transformer(
    component_dir: Path, modulation_cache: str = DEFAULT_PIPELINE.modulation_cache
) -> tuple[QwenImageTransformer, Checkpoint]:
    """Config parsed, checkpoint headers checked, model built on the meta device: no weight read yet."""
    config = TransformerConfig.from_dict(read_config(component_dir), where=str(component_dir / "config.json"))
    checkpoint = Checkpoint(component_dir)
    check_checkpoint_dtypes(checkpoint.tensors, str(component_dir))  # FP8 tensors without scales
    with on_meta():
        model = QwenImageTransformer(config, modulation_cache=modulation_cache)
    checkpoint.check_matches(model, str(component_dir))
    return model, checkpoint


def fill_transformer(
    model: QwenImageTransformer,
    checkpoint: Checkpoint,
    where: str,
    dtype: torch.dtype,
    device,
    updates: Sequence,
    quantization: Quantization = DEFAULT_PIPELINE.quantization,
    fp8_layers: Fp8Layers = DEFAULT_PIPELINE.fp8_layers,
) -> QwenImageTransformer:
    """Stream the weights in and merge the LoRA updates; with a quantization, each Linear weight
    of the layer set `fp8_layers` is merged and then quantized as it arrives, so the
    full-precision DiT is never held."""
    quantizer = None
    if check_quantization(quantization) != "none":
        quantizer = Fp8Quantizer(quantization, updates, keep=fp8_keep(fp8_layers))
    load_streaming(model, checkpoint, where, dtype, device, transform=quantizer)
    merge_updates(model, updates if quantizer is None else quantizer.unmerged)  # unquantized layers
    return model


def load_scheduler(component_dir: Path) -> SchedulerConfig:
    """From a scheduler folder, or from a scheduler_config.json given directly."""
    component_dir = Path(component_dir)
    given_file = component_dir.is_file() or component_dir.suffix == ".json"
    path = component_dir if given_file else component_dir / "scheduler_config.json"
    if not path.is_file():
        raise WeightsError(f"{path}: missing. The scheduler folder needs scheduler_config.json.")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightsError(f"{path}: not valid JSON ({e}).") from None
    return SchedulerConfig.from_dict(raw, where=str(path))


def load_text_encoder(root: Path, device, dtype) -> TextEncoder | None:
    te_dir = root / "text_encoder"
    if not te_dir.is_dir():
        return None
    if text_encoder_kind(te_dir) == "tiny":
        from ditfleet.model.tiny.text_encoder import TinyTextEncoder

        return TinyTextEncoder.load(root, device=device, dtype=dtype)
    # An edit checkpoint's processor/ (Qwen2VLProcessor): its Qwen2.5-VL sees the source images.
    processor = root / "processor" if (root / "processor").is_dir() else None
    return QwenVLTextEncoder.from_dirs(te_dir, root / "tokenizer", device, dtype, processor)


def edit_conditioning(root: Path) -> QwenImageEdit | None:
    """How the checkpoint at `root` conditions on source images (its model_index.json's
    `_class_name`, and its own source area when it names one: model.qwen_image.edit), as the
    pipeline's EditConditioning; None for a text-to-image one or a folder without it."""
    index = read_model_index(root)
    if index is None:
        return None
    try:
        style = edit_style_of(index, str(root / "model_index.json"))
    except ValueError as e:
        raise WeightsError(str(e)) from None
    return None if style is None else QwenImageEdit.of(style)


def load_pipeline(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    settings: PipelineSettings = DEFAULT_PIPELINE,
    *,
    load_text_encoder_too: bool = True,
    model_id: str | None = None,
    loras: Sequence[LoraSpec] = (),
    scheduler_config: str | Path | None = None,
    **overrides,
) -> TextToImagePipeline:
    """settings: how the pipeline computes (model.settings.PipelineSettings); `overrides` replace
    some of its knobs by name, e.g. `load_pipeline("tiny", cfg_mode="batched")`.

    model_id names the model in manifests (default: the path as given); a worker passes the
    remote source here when `path` is a node-local copy.

    `loras` are merged into the transformer, in order. `scheduler_config` (a scheduler_config.json
    or a folder holding one) replaces the checkpoint's scheduler, e.g. a distilled LoRA's few-step
    schedule over the base model. Both change the model revision the manifests record."""
    if not isinstance(settings, PipelineSettings):
        raise TypeError(f"load_pipeline: settings must be a PipelineSettings, got {settings!r}")
    settings = dataclasses.replace(settings, **overrides) if overrides else settings
    root = model_dir_layout(path)  # its class is model.family.load_pipeline's check
    # Everything that can be wrong with the files (a bad adapter or schedule, configs, shard
    # headers and keys of the transformer) fails here, before any weight is read or any device
    # memory is used; the (small) VAE is loaded on the CPU first for the same reason.
    adapters = [read_lora(spec) for spec in loras]
    scheduler = load_scheduler(Path(scheduler_config) if scheduler_config else root / "scheduler")
    revision = model_revision(root)
    if scheduler_config:
        override = json.dumps(scheduler.to_dict(), sort_keys=True)
        revision = hashlib.sha256(f"{revision}:scheduler:{override}".encode()).hexdigest()[:16]
    revision = quantized_revision(
        adapters_revision(revision, adapters), settings.quantization, settings.fp8_layers
    )
    check_device(settings.quantization, device)  # fp8 on a GPU without FP8 units: before any GPU work
    transformer, checkpoint = prepare_transformer(root / "transformer", settings.modulation_cache)
    updates = plan_updates(adapters, transformer)
    if load_text_encoder_too and (root / "text_encoder").is_dir():
        text_encoder_kind(root / "text_encoder")  # the right model, its shards complete,
        Checkpoint(root / "text_encoder")  # before the DiT takes device memory
    edit = edit_conditioning(root)
    # An edit model encodes its sources: its VAE keeps the encoder.
    vae = load_vae(root / "vae", device="cpu", dtype=dtype, with_encoder=edit is not None)
    fill_transformer(
        transformer,
        checkpoint,
        str(root / "transformer"),
        dtype,
        device,
        updates,
        settings.quantization,
        settings.fp8_layers,
    )
    transformer = transformer.eval().requires_grad_(False)
    # the image's q/k/v as one GEMM, once every weight is in (LoRA merged, FP8 layers kept apart)
    transformer.fuse_qkv()
    vae = vae.to(device)
    text_encoder = load_text_encoder(root, device, dtype) if load_text_encoder_too else None
    return TextToImagePipeline(
        transformer,
        vae,
        scheduler,
        text_encoder,
        model_id=model_id or str(path),
        model_revision=revision,
        settings=settings,
        prepare_inputs=prepare_inputs,
        edit=edit,
    )
