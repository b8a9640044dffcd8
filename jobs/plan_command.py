"""`ditfleet plan job.yaml [--json]`: what a run would do (rows, shards, buckets, images, the
VAE and DiT compile decisions, the memory plan), or for an incremental job what its next run would add.
Writes nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ditfleet.driver.memory_plan import JobMemoryPlan
from ditfleet.driver.plan import heaviest, idle_actors_warning
from ditfleet.driver.run_job import plan_input, preview_increment
from ditfleet.jobs.exit_codes import EXIT_OK
from ditfleet.jobs.plan_cost import cost_plan_line, estimate_cost, read_selftest
from ditfleet.jobs.run import check_memory, checked_spec, memory_plan_of
from ditfleet.jobs.spec import JobSpec
from ditfleet.model.family import model_family


def _print_memory(memory: JobMemoryPlan | None, spec: JobSpec) -> None:
    if memory is None:
        print(f"memory:  {spec.model.path}: configs not read here; `ditfleet inspect` a local copy")
        return
    for i, line in enumerate(memory.lines()):
        print(("memory:  " if i == 0 else "         ") + line)


def cmd_plan(args: argparse.Namespace) -> int:
    spec = checked_spec(args.job)
    if spec.input.incremental:
        code = _plan_incremental(spec, args.json)
        check_memory(spec, args.job)
        return code
    plan = plan_input(spec.to_driver_config())
    info: dict[str, Any] = {  # the --json document
        "input": plan.source,
        "files": len(plan.inputs),
        "rows": plan.total_rows,
        "images": plan.total_images,
        "shards": len(plan.shards),
        "shard_size": plan.config.shard_size,
        "buckets": plan.bucket_usage,
        "output": spec.output_uri(),
        "actors": {"min": spec.workers.min, "max": spec.workers.max or spec.workers.min},
        "fingerprint": plan.fingerprint(),
    }
    idle = idle_actors_warning(
        len(plan.shards), plan.total_rows, plan.config.shard_size, info["actors"]["max"]
    )
    info["warnings"] = [*plan.warnings, *([idle] if idle else [])]
    info["images_per_bucket"] = dict(plan.images_per_bucket)
    info["sources_per_bucket"] = {
        b: [f"{w}x{h}" for w, h in sizes] for b, sizes in plan.sources_per_bucket.items()
    }
    info["compile_vae"] = _vae_compile_plan(spec)
    info["compile_dit"] = _dit_compile_plan(spec, plan.total_images, len(plan.bucket_usage))
    info["step_cache"] = _step_cache_plan(spec, args.job)
    info["quality_gate"] = _gate_plan(spec, plan.total_images)
    info["licence"] = spec.model_licence.to_dict()
    info["sampling"] = spec.sampling_defaults.to_dict()
    if args.selftest:
        lines = read_selftest(args.selftest)
        info["cost"] = estimate_cost(
            spec,
            lines,
            args.selftest,
            compiled_dit=info["compile_dit"]["on"],
            compiled_vae=info["compile_vae"]["on"],
            # an edit job's heaviest row, whichever its bucket: its sources' tokens in each step
            sources=heaviest(plan.sources_per_bucket.values()),
            transformer_config=_transformer_config(spec) if plan.sources_per_bucket else None,
        )
    memory = memory_plan_of(spec, plan.sources_per_bucket)
    info["memory"] = memory.to_dict() if memory is not None else None
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_plan_text(info, plan.images_per_bucket, info["warnings"])
        print(f"compile: {info['compile_vae']['line']}; {info['compile_dit']['line']}")
        print(f"step cache: {info['step_cache']['line']}")
        if info["quality_gate"]:
            print(f"quality gate: {info['quality_gate']['line']}")
        print(f"licence: {spec.model_licence.describe()}")
        print(f"sampling: {spec.sampling_defaults.line()}")
        for note in spec.sampling_defaults.notes:
            print(f"note: {note}")
        if "cost" in info:
            print(f"cost:    {cost_plan_line(info['cost'])}")
        _print_memory(memory, spec)
    if memory is not None and spec.workers.gpu_memory_gb is not None:
        memory.check(args.job)
    return EXIT_OK


def _vae_compile_plan(spec: JobSpec) -> dict:
    """compile.vae as an actor will resolve it (CompileConfig.vae_on, without torch)."""
    from ditfleet.compile.config import VAE_CPU_COMPILE_REPAID_AFTER_IMAGES

    setting = spec.compile.vae
    on = spec.compile_config().vae_on(spec.actor_device())
    head = f"vae {'auto -> ' if setting == 'auto' else ''}{'on' if on else 'off'}"
    if setting == "auto" and not on:
        head += (
            f" (CPU actors: a bucket's compile is repaid after about "
            f"{VAE_CPU_COMPILE_REPAID_AFTER_IMAGES:,} images of it; compile.vae: true to compile)"
        )
    return {"setting": setting, "on": on, "line": head}


def _dit_compile_plan(spec: JobSpec, images: int, buckets: int) -> dict:
    """compile.dit as an actor will resolve it (CompileConfig.dit_on, without torch) and the
    warm-up it adds per actor."""
    from ditfleet.compile.config import AUTO_DIT_IMAGES_PER_BUCKET, DIT_WARMUP_S_PER_BUCKET

    setting = spec.compile.dit
    on_cpu = spec.actor_device() == "cpu"
    actors = spec.workers.max or spec.workers.min
    per_actor = images // max(1, actors)
    on = spec.compile_config().dit_on(spec.actor_device(), per_actor, buckets)
    if setting == "auto":
        why = "CPU actors" if on_cpu else f"about {per_actor} images per actor for {buckets} bucket(s)"
        head = f"dit auto -> {'on' if on else 'off'} ({why}; on from {AUTO_DIT_IMAGES_PER_BUCKET} per bucket on CUDA)"
    else:
        head = f"dit {'on' if on else 'off'}"
    low, high = (b * max(1, buckets) for b in DIT_WARMUP_S_PER_BUCKET)
    warmup = (low, high) if on and not on_cpu else (0, 0)
    line = head + (
        f": adds about {low}-{high} s of warm-up per actor (none with the shared compile cache)"
        if warmup[1]
        else ""
    )
    return {"setting": setting, "on": on, "warmup_s": list(warmup), "line": line}


def _gate_plan(spec: JobSpec, images: int) -> dict:
    """quality.gate's bounds on the work: every image tried once, at most max_tries times. A retry
    round runs at the job's batch size, so the memory peak is the plan's below; {} without a gate."""
    gate = spec.gate_config()
    if gate is None:
        return {}
    most = images * gate.max_tries
    line = (
        f"{gate.scorer} >= {gate.min:g}, up to {gate.max_tries} tries an image: {images}-{most} images "
        f"generated (1-{gate.max_tries}x the DiT work); retries run at the same batch size, so the "
        "memory peak below holds"
    )
    return {**dataclasses.asdict(gate), "most_images_generated": most, "line": line}


def _step_cache_plan(spec: JobSpec, job: str) -> dict:
    """sampling.step_cache as the model will run it, and the most DiT work its settings can save."""
    config = spec.sampling.step_cache
    if config is None:
        return {"setting": "off", "most_work_saved": 0.0, "line": "off (exact)"}
    steps, layers = spec.sampling_defaults.values["steps"], _dit_layers(spec)
    if layers is None:
        line = f"{config.method}: the model's depth is not read here; measure with `ditfleet calibrate {job}`"
        return {"setting": config.to_dict(), "most_work_saved": None, "line": line}
    most = config.most_work_saved(steps, layers)
    line = (
        f"{config.runs_as(layers)}: at most {most:.0%} of the DiT work saved at {steps} steps "
        f"(from the settings; what it saves depends on the images: measure with `ditfleet calibrate {job}`)"
    )
    return {"setting": config.to_dict(), "most_work_saved": round(most, 4), "line": line}


def _dit_layers(spec: JobSpec) -> int | None:
    """The DiT's block count from its config.json, for a local (or the bundled) model."""
    config = _transformer_config(spec)
    try:
        return int(config["num_layers"]) if config is not None else None
    except (ValueError, KeyError):
        return None


def _transformer_config(spec: JobSpec) -> dict | None:
    """The DiT's config.json of a local (or the bundled) model; None for a remote one."""
    path = spec.model_path()
    if "://" in path:
        return None
    root = model_family(path).bundled_dir or Path(path)
    try:
        config = json.loads((root / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _print_plan_text(info: dict, images_per_bucket: Mapping[str, int], warnings: Sequence[str] = ()) -> None:
    print(f"input:   {info['input']} ({info['files']} file(s))")
    print(
        f"rows:    {info['rows']}, images: {info['images']}, in {info['shards']} shard{'s' if info['shards'] != 1 else ''} of up to {info['shard_size']} rows"
    )
    print("buckets: " + ", ".join(f"{b} {n} images" for b, n in images_per_bucket.items()))
    for bucket, sizes in info["sources_per_bucket"].items():  # an edit job's
        n = len(sizes)
        print(
            f"sources: {bucket}: up to {n} source{'s' * (n > 1)} a row ({', '.join(sizes)}: its heaviest row)"
        )
    print(f"output:  {info['output']}")
    print(f"actors:  {info['actors']['min']}..{info['actors']['max']}")
    for warning in warnings:
        print(f"warning: {warning}")


def _plan_incremental(spec: JobSpec, as_json: bool) -> int:
    """`ditfleet plan` of an incremental job: what its next run would add (writes nothing)."""
    plan = preview_increment(spec.to_driver_config())
    todo = plan.todo
    info = {
        "input": spec.input_uri(),
        "incremental": True,
        "files": plan.files,
        "next_run": plan.record.run if plan.record is not None else None,
        "new_files": len(plan.record.files) if plan.record is not None else 0,
        "new_shards": len(plan.new_shards),
        "carried_shards": len(plan.carried),
        "rows": sum(s.num_rows for s in todo),
        "images": sum(s.num_images for s in todo),
        "skipped_rows": plan.record.skipped_rows if plan.record is not None else 0,
        "output": spec.output_uri(),
        "fingerprint": plan.fingerprint,
    }
    if as_json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"input:   {info['input']} ({info['files']} file(s), incremental)")
    for line in plan.describe() or ["nothing new: a run now would do nothing"]:
        print(line)
    print(f"to run:  {len(todo)} shards, {info['rows']} rows, {info['images']} images")
    print(f"output:  {info['output']}")
    return EXIT_OK
