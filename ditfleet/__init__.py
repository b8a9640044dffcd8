"""ditfleet: image datasets from a diffusion transformer on a Ray cluster.

The face for users who drive it from Python (the `ditfleet` command does the same from a shell):

    import ditfleet
    summary = ditfleet.run("job.yaml")              # plan, generate, commit; resumes a rerun
    spec = ditfleet.load_spec("job.yaml")           # the validated JobSpec (SpecError names the key)
    pipe = ditfleet.load_pipeline("tiny")           # the model alone: prompts -> images
    ditfleet.to_pil(pipe.generate(...))              # those images as PIL images

The layers install under this name (ditfleet.model, ditfleet.compile, ditfleet.workers,
ditfleet.driver, ditfleet.jobs), so a user's own `model/` or `jobs/` package cannot shadow
them. Names load on first use: `import ditfleet` imports neither torch nor Ray.
"""

from __future__ import annotations

from ditfleet.model.lazy_exports import lazy_exports

# name -> the module that defines it
_WHERE = {
    "JobSpec": "jobs.spec",
    "NoRayCluster": "jobs.ray_auth",
    "SpecError": "jobs.spec",
    "load_pipeline": "model.qwen_image.loader",
    "load_spec": "jobs.spec",
    "run": "jobs.run",
    "to_pil": "workers.output.codec",
}

__all__ = sorted(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
