"""The job spec: one YAML (or JSON) file that says what to generate, where, and how.

    spec = load_spec("job.yaml")          # SpecError naming the file, line and key on any problem
    run_job(spec.to_driver_config(), spec.to_worker_config())

Each module's docstring says its part: sections, job (JobSpec), file (the reader), problems.
"""

from __future__ import annotations

from .file import SpecError, load_spec, parse_spec
from .job import JobSpec

__all__ = ["JobSpec", "SpecError", "load_spec", "parse_spec"]
