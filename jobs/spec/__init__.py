"""The job spec: one YAML (or JSON) file that says what to generate, where, and how.

    spec = load_spec("job.yaml")          # SpecError naming the file, line and key on any problem
    run_job(spec.to_driver_config(), spec.to_worker_config())

- `sections`: one pydantic model per section of the file, each field saying why it exists;
- `job`: `JobSpec`, the whole file, and how it maps onto the lower layers' configs;
- `file`: reading the file, with errors that name the file, line and key;
- `problems`: validation problems as one SpecError (shared by the file reader and `JobSpec.with_changes`).
"""

from __future__ import annotations

from .file import SpecError, load_spec, parse_spec
from .job import JobSpec
from .sections import TINY_MODEL

__all__ = ["TINY_MODEL", "JobSpec", "SpecError", "load_spec", "parse_spec"]
