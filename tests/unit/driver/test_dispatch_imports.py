"""The dispatcher knows nothing of the output: it hands back every actor it started
(DispatchResult.actors) and the composition root, driver/run_job.py, fences them after dispatch
returns (driver.output.fence), before anything closes the output."""

from __future__ import annotations

import ast

from tests.support.paths import REPO


def _imported(path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_dispatch_imports_no_output_module_and_run_job_fences() -> None:
    for path in sorted((REPO / "driver" / "dispatch").glob("*.py")):
        reaching = {m for m in _imported(path) if m.startswith("ditfleet.driver.output")}
        assert not reaching, f"{path.relative_to(REPO)} imports {sorted(reaching)}"
    run_job = (REPO / "driver" / "run_job.py").read_text()
    assert "ditfleet.driver.output.fence" in _imported(REPO / "driver" / "run_job.py")
    assert "wait_actors_gone(result.actors" in run_job
