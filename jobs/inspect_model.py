"""`ditfleet inspect MODEL`: what a model folder holds and what it needs of a GPU.

Reads the config files and the safetensors headers only (never a weight), so it runs in a
second on a 58 GB checkpoint, on a laptop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ditfleet.compile.buckets import default_buckets
from ditfleet.driver.memory_plan import GPU_SIZES_GB, MemoryRequest, plan_kwargs, read_model_memory
from ditfleet.jobs.spec.sampling_defaults import checkpoint_label, recognise
from ditfleet.model.family import MemoryFormula, PublishedDefaults, model_family, resolve_model_dir
from ditfleet.model.loading.quantization import check_quantization
from ditfleet.model.loading.weights import WeightsError
from ditfleet.model.memory import (
    DTYPE_BYTES,
    GB,
    TEXT_ENCODER_PLACEMENTS,
    CheckpointSize,
    ModelMemory,
    checkpoint_size,
)


def inspect_model(request: MemoryRequest, gpus_gb: Sequence[float] = GPU_SIZES_GB) -> dict[str, Any]:
    """Components (parameters, checkpoint headers, bytes in the request's dtype) and, per bucket
    (default: the largest), the peak and the largest batch for every text-encoder placement on
    every GPU size (so the request's own text_encoder and gpu_memory_gb are not read)."""
    model = read_model_memory(request.model_path, request.s3)
    memory = model_family(request.model_path).memory
    if model is None and not getattr(memory, "plans_from_configs", True):
        # A family whose memory is measured at warm-up (a diffusers pipeline): no table to show.
        return {
            "model": request.model_path,
            "sampling_defaults": _sampling_defaults(request),
            "memory": "measured at warm-up on each actor (weights from the safetensors headers), not planned from configs",
        }
    if model is None:
        raise ValueError(
            f"{request.model_path}: hf:// models are not read here; inspect a local copy of the folder"
        )
    largest = max(default_buckets(request.model_path), key=lambda b: b.pixels).name
    request = replace(request, buckets=request.buckets or (largest,))
    return {
        "model": request.model_path,
        "sampling_defaults": _sampling_defaults(request),
        "dtype": request.dtype,
        "quantization": request.quantization,
        "text_len": request.text_len,
        "components": _components(model, request),
        "plans": _plans(memory, model, request, gpus_gb),
        "math_attention_extra_gb": _math_attention_extra(memory, model, request),
    }


def _sampling_defaults(request: MemoryRequest) -> dict[str, Any]:
    """The published schedule the checkpoint is recognised by (jobs.spec.sampling_defaults), the
    defaults a job that says nothing runs it with; {} when it is none of them."""
    found, notes = recognise(request.model_path, (), None, request.s3)
    if found is None:
        return {"notes": list(notes)} if notes else {}
    out = {**found.schedule.defaults(), "from": checkpoint_label(found)}
    if isinstance(
        found.schedule, PublishedDefaults
    ):  # a diffusers checkpoint's: how guidance acts, its text length
        out.update(guidance=found.schedule.guidance, max_sequence_length=found.schedule.text_length())
    return {**out, "notes": list(notes)} if notes else out


def _components(model: ModelMemory, request: MemoryRequest) -> dict[str, Any]:
    """Per component: its parameters, their bytes in the request's dtype and the headers of its
    checkpoint; under a quantization (model.quantization) the transformer's entry also says its
    bytes as loaded, which every plan counts."""
    root = None if "://" in request.model_path else resolve_model_dir(request.model_path)
    e = DTYPE_BYTES[request.dtype]
    components: dict[str, Any] = {}
    for name, n in model.params().items():
        entry: dict[str, Any] = {"params": n, f"{request.dtype}_gb": round(n * e / GB, 3)}
        ck = _checkpoint(root, name)
        if ck is not None:
            entry["checkpoint"] = {
                "files": ck.files, "tensors": ck.tensors, "params": ck.params,
                "gb": round(ck.bytes / GB, 3), "dtypes": list(ck.dtypes),
            }  # fmt: skip
        components[name] = entry
    if request.quantization != "none":
        loaded = model.dit_weight_bytes(e, check_quantization(request.quantization))
        components["transformer"][f"{request.quantization}_gb"] = round(loaded / GB, 3)
    return components


def _plans(
    memory: MemoryFormula, model: ModelMemory, request: MemoryRequest, gpus_gb: Sequence[float]
) -> list[dict[str, Any]]:
    """Per bucket and text-encoder placement: the peak at the request's batch size and, per GPU
    size, whether it fits and the largest batch that does."""
    batch = request.batch_size
    plans = []
    for bucket in request.buckets:
        w, h = (int(v) for v in bucket.lower().split("x"))
        for placement in TEXT_ENCODER_PLACEMENTS if "text_encoder" in model.params() else ("gpu",):
            kw: dict[str, Any] = dict(height=h, width=w, **plan_kwargs(request, text_encoder=placement))
            base = memory.plan(model, batch=batch, **kw)
            row = {"bucket": bucket, "text_encoder": placement, "batch": batch, "peak_gb": round(base.peak / GB, 2),
                   "peak_phase": base.peak_phase, "phases_gb": base.to_dict()["phases_gb"], "gpus": {}}  # fmt: skip
            for gb in gpus_gb:
                p = memory.plan(model, batch=batch, gpu_memory_gb=gb, **kw)
                row["gpus"][f"{gb:g}"] = {
                    "fits": p.fits,
                    "peak_gb": round(p.peak / GB, 2),
                    "dit_swapped": p.dit_swapped,
                    "largest_batch": memory.largest_batch(model, gb, **kw),
                }
            plans.append(row)
    return plans


def _checkpoint(root: Path | None, component: str) -> CheckpointSize | None:
    """The component's safetensors headers; None for a remote model or a folder of configs only."""
    if root is None:
        return None
    try:
        return checkpoint_size(root / component)
    except WeightsError as e:
        if "no *.safetensors" in str(e):
            return None
        raise


def _math_attention_extra(
    memory: MemoryFormula, model: ModelMemory, request: MemoryRequest
) -> dict[str, float]:
    out = {}
    for bucket in dict.fromkeys(request.buckets):
        w, h = (int(v) for v in bucket.split("x"))
        extra = memory.math_attention_extra(model, h, w, request.text_len, DTYPE_BYTES[request.dtype])
        out[bucket] = round(extra / GB, 2)
    return out


def format_inspection(info: dict[str, Any]) -> str:
    lines = [f"model: {info['model']}"]
    published = info["sampling_defaults"]
    if "steps" in published:
        cfg = (
            "CFG off"
            if published["negative_prompt"] is None or published["true_cfg_scale"] <= 1
            else "true CFG"
        )
        cfg = published.get("guidance", cfg)
        lines.append(
            f"sampling defaults: {published['steps']} steps, true_cfg_scale {published['true_cfg_scale']:g} "
            f"({cfg}), negative_prompt {published['negative_prompt']!r} ({published['from']}); a job's values win"
        )
    else:
        lines.append("sampling defaults: ditfleet's (no published few-step schedule recognised)")
    lines += [f"  note: {note}" for note in published.get("notes", ())]
    if "max_sequence_length" in published:
        lines.append(f"text length: {published['max_sequence_length']} tokens ({published['from']})")
    if "memory" in info:
        return "\n".join([*lines, f"memory: {info['memory']}"])
    dtype, quantization = info["dtype"], info["quantization"]
    for name, c in info["components"].items():
        line = f"  {name:<13} {c['params'] / 1e9:7.3f} B params, {c[f'{dtype}_gb']:7.2f} GB in {dtype}"
        if f"{quantization}_gb" in c:
            line += f", {c[f'{quantization}_gb']:.2f} GB as {quantization}"
        ck = c.get("checkpoint")
        if ck:
            line += (
                f"; checkpoint: {ck['files']} file(s), {ck['tensors']} tensors, {ck['params'] / 1e9:.3f} B params, "
                f"{ck['gb']:.2f} GB {'/'.join(ck['dtypes'])}"
            )
        lines.append(line)
    dit = f", DiT {quantization}" if quantization != "none" else ""
    lines.append(
        f"memory plan ({dtype}{dit}, prompts up to {info['text_len']} tokens, serial CFG, one image per VAE decode; "
        "peak GB, then per GPU: fits and the largest batch):"
    )
    for row in info["plans"]:
        gpus = "  ".join(
            f"{gb} GB: {'fits' if g['fits'] else 'no'} (max batch {g['largest_batch']}"
            + (", DiT swapped while encoding" if g["dit_swapped"] else "")
            + ")"
            for gb, g in row["gpus"].items()
        )
        phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phases_gb"].items())
        lines.append(
            f"  {row['bucket']} x{row['batch']}, text encoder {row['text_encoder']:<7}: peak {row['peak_gb']:.1f} GB "
            f"({phases})  {gpus}"
        )
    for bucket, extra in info["math_attention_extra_gb"].items():
        lines.append(
            f"  {bucket}: attention without a fused kernel (masked math path) would add {extra:.1f} GB per image"
        )
    return "\n".join(lines)
